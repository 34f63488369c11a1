"""Every config leaf is read by something: a key that does nothing is a defect.

For each leaf `section.name` of the config tree, some module outside mtrain/config.py and config_checks.py must read `.name` (attribute
access, as every reader does: `cfg.engine.tp`, `e.tp`, `r.max_new_tokens`). A leaf whose name appears nowhere but in
its own declaration fails here, naming the key.
"""
import re
from pathlib import Path

from mtrain.config import RunConfig, _leaf_keys

REPO = Path(__file__).resolve().parents[1]
# the declaration and the cross-field checks are not readers
SOURCES = [p for d in ("mtrain", "kernels", "converters") for p in (REPO / d).rglob("*.py")
           if p.name not in ("config.py", "config_checks.py") or p.parent.name != "mtrain"]


def test_every_config_leaf_has_a_reader():
    text = "\n".join(p.read_text(encoding="utf-8") for p in SOURCES)
    unread = [key for key in _leaf_keys(RunConfig)
              if not re.search(rf"\.{re.escape(key.rsplit('.', 1)[1])}\b", text)]
    assert not unread, f"config keys read by nothing: {unread}"
