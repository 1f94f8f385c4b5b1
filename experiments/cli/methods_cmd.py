"""`kvjax methods`: every registered cache method, its arguments and what it equals in kvpress.

Prints one line per method (name, kvpress press, spec, description), or with
`--json` one JSON list: for each method its `name`, `description` (the
factory's first docstring paragraph), `arguments` (name and default each),
`paper`, `kvpress` (the kvpress 0.5.5 press it equals at kvpress's
defaults, or null), `spec` (the kvjax spec that equals that press, `{r}`
standing for kvpress's `compression_ratio`) and `proof` (the test that
compares kept positions with kvpress's). Plugins in $KVJAX_PLUGINS are
loaded first, so their methods are listed too.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON list on stdout")
    parser.add_argument("name", nargs="?", help="only this method")


def run(args) -> int:
    from kvjax.policies.methods import METHODS, describe_methods, did_you_mean, load_plugins

    load_plugins()
    methods = describe_methods()
    if args.name is not None:
        if args.name not in METHODS:
            raise ValueError(f"unknown method {args.name!r}{did_you_mean(args.name, METHODS)}; "
                             f"available: {', '.join(sorted(METHODS))}")
        methods = [m for m in methods if m["name"] == args.name]
    if args.json:
        print(json.dumps(methods, indent=1))
        return 0
    for m in methods:
        defaults = ", ".join(f"{a['name']}={a['default']}" for a in m["arguments"]
                             if not a.get("required")) or "-"
        print(f"{m['name']}: {m['description']}")
        print(f"    arguments: {defaults}")
        if m["paper"]:
            print(f"    paper: {m['paper']}")
        if m["kvpress"]:
            print(f"    equals kvpress {m['kvpress']} at compression_ratio=r, other arguments "
                  f"at kvpress's defaults: {m['spec']} ({m['proof']})")
    return 0
