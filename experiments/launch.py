"""`kvjax launch -n N -- COMMAND ...`: run COMMAND as N local processes of one JAX program.

    kvjax launch -n 2 --local-devices 4 -- kvjax generate --mesh data=2,model=4 \\
        --prompt "The capital of France is" --max-new-tokens 8

Each process gets `KVJAX_COORDINATOR=127.0.0.1:PORT` (a free loopback port),
`KVJAX_NUM_PROCESSES`, `KVJAX_PROCESS_ID` and `KVJAX_LOCAL_DEVICES` (fake CPU
devices per process; 0 keeps the platform's own); `kvjax` commands call
`models.sharding.init_distributed()` first, which runs `jax.distributed.initialize`
from them, so the processes form one mesh of N x local devices (CPU collectives
over gloo). A Python script does the same by calling `init_distributed()` before
touching a device. Process 0's output is printed; the others' only when they
fail. The exit status is the first non-zero one. On a real multi-host slice the
same variables come from the cluster's launcher (one process per host).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--processes", type=int, default=2, help="local processes (>= 1)")
    p.add_argument("--local-devices", type=int, default=4,
                   help="fake CPU devices per process (0 = the platform's own)")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0 = a free one)")
    p.add_argument("--timeout", type=float, default=0, help="seconds before the run is killed "
                                                            "(0 = none)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(cmd: list[str]) -> list[str]:
    """`kvjax ...` runs this interpreter's CLI (so the launched processes use the same env)."""
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd and cmd[0] == "kvjax":  # this interpreter's CLI, whatever `kvjax` is on PATH
        return [sys.executable, "-m", "experiments.cli", *cmd[1:]]
    return cmd


def run(args) -> int:
    cmd = command(args.cmd)
    if not cmd:
        print("kvjax: error: launch needs a command after --", file=sys.stderr)
        return 2
    if args.processes < 1 or args.local_devices < 0:
        print(f"kvjax: error: -n {args.processes} / --local-devices {args.local_devices}: need "
              f"-n >= 1 and --local-devices >= 0", file=sys.stderr)
        return 2
    port = args.port or free_port()
    procs = []
    for i in range(args.processes):
        env = dict(os.environ, KVJAX_COORDINATOR=f"127.0.0.1:{port}",
                   KVJAX_NUM_PROCESSES=str(args.processes), KVJAX_PROCESS_ID=str(i),
                   KVJAX_LOCAL_DEVICES=str(args.local_devices))
        env.pop("XLA_FLAGS", None) if args.local_devices else None
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    status = 0
    try:
        outputs = [p.communicate(timeout=args.timeout or None) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        print(f"kvjax: error: launch timed out after {args.timeout} s", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        return 130
    for i, (p, (out, err)) in enumerate(zip(procs, outputs)):
        if i == 0:
            sys.stdout.write(out)
        if p.returncode:
            sys.stderr.write(f"[process {i} exited {p.returncode}]\n{err[-4000:]}")
            status = status or p.returncode
    return status
