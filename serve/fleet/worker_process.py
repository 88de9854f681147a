"""`python -m serve.fleet.worker_process OPTIONS_JSON`: one fleet worker process, as a `--role all` gateway
starts it (`serve.fleet.run.run_all`), from the `ServeOptions` it hands over as JSON.

The serve library's own entry point, so that starting workers never calls back up into the application's CLI.
Secrets come in the environment, never on the command line: `QPACK_METRICS_KEY` and `QPACK_REDIS_URL` (the
Redis URL with its password; the options' own `redis` has it as ***). Progress goes to stderr; bad options or an unreachable Redis are one line there and exit code 2, as with
`qpack serve`.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from quantize.common.errors import QpackError
from serve.fleet.run import run_worker
from serve.options import ServeOptions


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    try:
        if len(argv) != 1:
            raise QpackError("usage: python -m serve.fleet.worker_process OPTIONS_JSON")
        options = ServeOptions.from_json(argv[0])
        if options.metrics_key is None and os.environ.get("QPACK_METRICS_KEY"):
            options = dataclasses.replace(options, metrics_key=os.environ["QPACK_METRICS_KEY"])
        if os.environ.get("QPACK_REDIS_URL"):  # the URL with its password, kept off the command line
            options = dataclasses.replace(options, redis=os.environ["QPACK_REDIS_URL"])
        if options.role != "worker":
            raise QpackError(f"serve.fleet.worker_process runs --role worker (got --role {options.role})")
        options.validate()
        run_worker(options, _log)
    except QpackError as exc:
        _log(f"error: {exc.message}")
        return exc.exit_code
    except KeyboardInterrupt:
        _log("error: interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
