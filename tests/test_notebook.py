"""The example notebook runs top to bottom (a real run on a real local cluster)."""

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


def test_quickstart_notebook_runs():
    import nbformat
    from nbclient import NotebookClient

    path = REPO / "examples" / "quickstart.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plot was drawn
