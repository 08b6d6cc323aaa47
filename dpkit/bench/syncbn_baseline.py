"""``syncbn.py`` as of a git revision, imported as a separate module: the A/B of a change, timed in the same run as
the layer of the working tree (``syncbn_benchmark.py --baseline REV``, rows "ours@REV").

    module = load_baseline("main", repo)       # repo: the folder whose git history holds syncbn.py
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
from types import ModuleType

from dpkit.comm import process_groups, transport

# The root modules syncbn.py imported before they moved into dpkit, and where they are now.
BEFORE_THE_PACKAGE = {"transport": transport, "dist_utils": process_groups}


def load_baseline(revision: str, repo: str) -> ModuleType:
    """``syncbn.py`` of ``revision`` in the git repository at ``repo``; a revision whose ``SyncBatchNorm`` takes no
    ``transport=`` is refused (ValueError): it chooses its communication inside, so it cannot be timed over the
    run's transports."""
    source = subprocess.run(["git", "show", f"{revision}:syncbn.py"], capture_output=True, text=True, check=True,
                            cwd=repo).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="syncbn_baseline_"), "syncbn_baseline.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("syncbn_baseline", path)
    module = importlib.util.module_from_spec(spec)
    # A revision from before the package imported its modules from the root: give it them under those names.
    missing = {old: new for old, new in BEFORE_THE_PACKAGE.items() if old not in sys.modules}
    sys.modules.update(missing)
    try:
        spec.loader.exec_module(module)
    finally:
        for old in missing:
            sys.modules.pop(old, None)
    if "transport" not in inspect.signature(module.SyncBatchNorm).parameters:
        raise ValueError(f"--baseline {revision}: syncbn.py at that revision predates the transport seam "
                         "(SyncBatchNorm(..., transport=)); give a later revision")
    return module
