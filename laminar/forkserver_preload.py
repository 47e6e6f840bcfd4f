"""The one module a local cluster's forkserver preloads: it imports each of
:data:`laminar.cluster.WORKER_PRELOAD`.

``multiprocessing.forkserver`` skips a preload that raises ``ImportError`` and dies of any
other error, and with it every worker start of the process ("Nanny failed to start"). A
module can raise anything as it is imported (transformers: ``ValueError`` for a mistyped
``HF_HUB_ETAG_TIMEOUT``; a broken shared library: ``OSError``); here such an error is
left to the worker that needs the module, which raises it with its traceback.
"""

import importlib

from laminar.cluster import WORKER_PRELOAD

for _name in WORKER_PRELOAD:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001, S110 — the worker that imports it will raise it
        pass
