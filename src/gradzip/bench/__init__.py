"""Benchmarks: ``gradzip bench allreduce`` (:mod:`.micro`), ``gradzip bench codecs`` (:mod:`.codecs`)
and ``gradzip bench models`` (:mod:`.models`)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from ..comm.launch import free_port, spawn_local

__all__ = ["free_port", "spawn_local", "write_json"]


def write_json(report: Dict[str, Any], path: Optional[str]) -> Dict[str, Any]:
    """Save ``report`` to ``path`` (when one is given; its folder made where missing) and hand it back."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return report
