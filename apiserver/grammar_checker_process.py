"""The grammar checker's own process: llguidance's work for one API server, where a grammar that kills or stalls it
costs this process and the request that sent it, not the API server and every connection it serves.

A client's grammar can do both (measured with llguidance 1.9 on a 2-core AMD EPYC):
- overflow the stack of llguidance's compiler, a SIGSEGV: a JSON schema whose `$ref`s chain 1,000 deep (105 KB of
  schema), a Lark grammar whose rules chain 3,000 deep, or whose terminals chain 6,400 deep;
- run for seconds, holding the event loop: a GBNF grammar is converted to Lark in Python, 1.9 s for 1,000 rules
  (27 KB), 13 s for 3,000, 65 s for 6,000; a regex of 100,000 alternatives takes 3 s to check.
In the API server's event loop the first took the server down with every stream on it, and six such requests in a
minute took the whole group down (--max-restarts); the second stalls every client of that server.

It first writes {"ready": true} (its imports done). Then requests come one JSON object a line on stdin, answers go
one a line on stdout, in order:
  {"op": "build", "args": [kind, value, any_whitespace, max_choices]} -> {"grammar": text} (ipc.grammar.from_constraint)
  {"op": "check", "args": [grammar]}                                  -> {"ok": true}
either may answer {"error": reason} instead. stdin's end (the API server is gone) ends the process.

Each runs in a thread with a stack of CHECK_STACK_BYTES, a quarter of the 8 MB main thread an engine steps a
grammar's matcher in (and far less than its compiler's thread: enginecore/grammar_compiler.py), so what passes here
has room to spare there: a schema's `$ref`s chain some 200 deep in it, ten times what OpenAI's structured outputs
allow (10 levels of nesting).
"""
from __future__ import annotations

import json
import sys
import threading

from ipc import grammar as grammars

CHECK_STACK_BYTES = 2 << 20


def answer(request: dict) -> dict:
    """The answer to one request."""
    args = request["args"]
    try:
        if request["op"] == "build":
            return {"grammar": grammars.from_constraint(*args)}
        grammars.check(*args)
        return {"ok": True}
    except grammars.GrammarError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # llguidance raising what it should not: still the grammar's fault, and said so
        return {"error": grammars.short_reason(f"{type(exc).__name__}: {exc}")}


def serve(stdin, stdout) -> None:
    stdout.write(b'{"ready": true}\n')
    stdout.flush()
    for line in stdin:
        stdout.write(json.dumps(answer(json.loads(line))).encode() + b"\n")
        stdout.flush()


def main() -> None:
    from setproctitle import setproctitle

    from ipc.lifeline import die_with_parent

    die_with_parent(None)  # and stdin's end, whichever comes first
    if len(sys.argv) > 1:
        setproctitle(sys.argv[1])
    threading.stack_size(CHECK_STACK_BYTES)
    worker = threading.Thread(target=serve, args=(sys.stdin.buffer, sys.stdout.buffer), name="check")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
