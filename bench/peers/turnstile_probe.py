"""Turnstile side of the correctness probe (bench/peers/run): the same six bad inputs through
the `turnstile` command line, as a user would run it (exit statuses fixed by
../shared/spec/conversation-v1.md §3):

- histories: `turnstile validate FILE --json` (0 ready, 3 waiting, 1 rejected) and
  `turnstile render FILE --adapter anthropic-messages@1 --model claude-sonnet-4-5`
  (0 = bytes printed, anything else = nothing rendered);
- cut stream: `turnstile assemble FILE --adapter ID --tools tools.json --json`
  (0 committed, 6 nothing committed).

Plain python3, no third-party packages.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import probe_line  # noqa: E402

ADAPTER_FOR = {"anthropic": "anthropic-messages@1", "openai-chat": "openai-chat@1"}


def run(command):
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--turnstile", required=True)
    parser.add_argument("--inputs", required=True)
    args = parser.parse_args()
    directory = os.path.join(args.inputs, "probe")
    for case in ("missing_result", "orphan_result", "duplicate_result", "unknown_part", "mid_system"):
        path = os.path.join(directory, f"{case}.v1.json")
        status, out, _ = run([args.turnstile, "validate", path, "--json"])
        verdict = json.loads(out) if out.strip() else {}
        render_status, render_out, render_err = run(
            [args.turnstile, "render", path, "--adapter", "anthropic-messages@1", "--model", "claude-sonnet-4-5"])
        probe_line("turnstile", case, {
            "outcome": "validated", "validate_exit": status, "status": verdict.get("status"),
            "codes": sorted({v["code"] for v in verdict.get("violations", [])}),
            "render_exit": render_status, "render_stdout_bytes": len(render_out),
        })
    tools = os.path.join(args.inputs, "tools.json")
    for api, adapter in ADAPTER_FOR.items():
        path = os.path.join(directory, f"cut_stream.{api}.sse")
        status, out, _ = run([args.turnstile, "assemble", path, "--adapter", adapter, "--tools", tools, "--json"])
        try:
            answer = json.loads(out)
        except ValueError:
            answer = {"raw": out[:300]}
        probe_line("turnstile", f"cut_stream/{api}", {"outcome": "assemble", "exit": status, "answer": answer})


if __name__ == "__main__":
    main()
