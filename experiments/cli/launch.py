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
import json
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
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout: each process's exit status and "
                        "process 0's output (parsed, as `result`, when it is one JSON object)")
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
        return [sys.executable, "-m", "experiments.cli.main", *cmd[1:]]
    return cmd


MAX_PROCESSES = 256
"""The most local processes `launch` starts (each is a whole JAX runtime)."""


def check_bounds(args) -> str:
    """The first out-of-range option as one line ("" when all are in range)."""
    import math

    if not 1 <= args.processes <= MAX_PROCESSES:
        return f"-n {args.processes}: must be an integer in [1, {MAX_PROCESSES}]"
    if not 0 <= args.local_devices <= 1024:
        return f"--local-devices {args.local_devices}: must be an integer in [0, 1024]"
    if not 0 <= args.port <= 65535:
        return f"--port {args.port}: must be in [0, 65535] (0 = a free one)"
    if 0 < args.port < 1024:
        return f"--port {args.port}: must be 0 (a free one) or in [1024, 65535] (unprivileged)"
    if not (math.isfinite(args.timeout) and args.timeout >= 0):
        return f"--timeout {args.timeout}: must be a finite number of seconds >= 0 (0 = none)"
    return ""


def run(args) -> int:
    cmd = command(args.cmd)
    if not cmd:
        print("kvjax: error: launch needs a command after --", file=sys.stderr)
        return 2
    problem = check_bounds(args)
    if problem:
        print(f"kvjax: error: {problem}", file=sys.stderr)
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
        if i == 0 and not args.json:
            sys.stdout.write(out)
        if p.returncode:
            sys.stderr.write(f"[process {i} exited {p.returncode}]\n{err[-4000:]}")
            status = status or p.returncode
    if args.json:
        out = outputs[0][0]
        report = {"command": cmd, "processes": args.processes, "status": status,
                  "returncodes": [p.returncode for p in procs], "output": out}
        try:
            report["result"] = json.loads(out)
        except ValueError:
            pass
        print(json.dumps(report))
    return status
