"""The ending the GPU check scripts share: whatever happens, their engines are shut down and the summary (with the
error and its traceback when there is one) is printed and written to $OUT/<filename>, so a run that dies still says
how far it got."""
from __future__ import annotations

import contextlib
import json
import os
import traceback
from typing import Iterator


@contextlib.contextmanager
def reported(summary: dict, filename: str) -> Iterator[list]:
    """`with reported(summary, "x.json") as engines:` append each engine to `engines` once it is made."""
    engines: list = []
    try:
        yield engines
    except BaseException as e:
        summary["error"] = f"{type(e).__name__}: {e}"
        summary["traceback"] = traceback.format_exc()[-4000:]
        raise
    finally:
        for eng in engines:
            eng.shutdown()
        print(json.dumps(summary, indent=1))
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, filename), "w") as f:
                json.dump(summary, f, indent=1)
