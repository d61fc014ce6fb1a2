"""Faults injected for real into one rank of a `shardshift` command, through a `sitecustomize`.

The launcher forks its ranks (`shardshift.launch.fork_rank`), so code that runs as an interpreter
starts runs once, in the launcher, before any rank exists. The `sitecustomize` written here
registers an at-fork hook instead: in each fork it watches Python calls (`sys.setprofile`) until
the rank's environment says which rank it is, and in rank `rank` until `function` is called;
then it does `action` there (a Python statement: ``sys.exit("...")``, or
``os.kill(os.getpid(), signal.SIGKILL)``). The other ranks stop watching as soon as they know they
are not that rank.
"""

from __future__ import annotations

import os
from pathlib import Path

_SITE = """\
import os, signal, sys

def _trap(frame, event, arg):
    rank = os.environ.get("RANK")
    if rank is not None and rank != {rank!r}:
        sys.setprofile(None)
    elif rank is not None and event == "call" and frame.f_code.co_name == {function!r}:
        sys.setprofile(None)
        {action}

os.register_at_fork(after_in_child=lambda: sys.setprofile(_trap))
"""


def fault_env(tmp_path: Path, rank: int, function: str, action: str) -> dict[str, str]:
    """The environment for a command whose rank `rank` does `action` as it calls `function`."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE.format(rank=str(rank), function=function, action=action))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
