"""`safepoint plot` and the norm trend (safepoint.ops.trend): the norms of a real tiny training run, ingested,
against the norms torch computes from the very state it saved; steps judged invalid, stale or corrupt marked;
the picture written and read back; the ingest flow's markdown artifact."""

from __future__ import annotations

import copy
import math
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from safepoint.catalog.store import open_catalog
from safepoint.cli.main import main
from safepoint.core.config import Config
from safepoint.core.states import CheckpointState as C
from safepoint.local.commit import commit
from safepoint.ops import trend
from safepoint.ops.ingest import ingest
from tests.helpers_catalog import seed

RUN = "tiny"


def _global(tensors) -> float:
    return math.sqrt(sum(float(t.double().norm()) ** 2 for t in tensors))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Steps 1..5 of Adam on an MLP, each torch.save'd and ingested; step 3 saved with NaN in a second moment
    (invalid), step 5 with step 4's optimizer state (stale). Step 6 seeded corrupt. Returns the catalog URL
    and the norms torch computed of each saved state."""
    root = tmp_path_factory.mktemp("plot")
    mp = pytest.MonkeyPatch()
    mp.setenv("SAFEPOINT_HOME", str(root / "home"))
    (root / "home").mkdir()
    url = f"sqlite:///{root / 'catalog.db'}"
    cat = open_catalog(url)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    expected, previous = {}, None
    for step in range(1, 6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sd = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        if step == 3:
            sd["optimizer"]["state"][0]["exp_avg_sq"].view(-1)[:2] = float("nan")
        if step == 5:
            sd["optimizer"] = previous
        previous = copy.deepcopy(sd["optimizer"])
        states = sd["optimizer"]["state"].values()
        expected[step] = {"parameters": _global(sd["model"].values()),
                          "optimizer exp_avg": _global(s["exp_avg"] for s in states),
                          "optimizer exp_avg_sq": _global(s["exp_avg_sq"] for s in states)}
        folder = root / "ckpt" / f"step-{step}"
        folder.mkdir(parents=True)
        torch.save(sd, folder / "model.pt")
        commit(folder, RUN, step)
        ingest(folder, [(root / "durable").as_uri()], cat, Config())
    seed(cat, root, RUN, 6, state=C.CORRUPT)
    yield url, expected
    mp.undo()


def test_the_trend_holds_the_norms_torch_computed_and_marks_bad_steps(run):
    url, expected = run
    t = trend.run_trend(open_catalog(url), RUN)
    assert [(p.step, p.state, p.marks) for p in t.points] == [
        (1, "verified", ()), (2, "verified", ()), (3, "invalid", ("invalid",)), (4, "verified", ()),
        (5, t.points[4].state, t.points[4].marks), (6, "corrupt", ("corrupt",))]
    assert "stale" in t.points[4].marks  # every optimizer tensor of step 5 is step 4's
    assert t.series == ["parameters", "optimizer exp_avg", "optimizer exp_avg_sq"]
    for p in t.points[:5]:
        want = dict(expected[p.step])
        if p.step == 3:
            want["optimizer exp_avg_sq"] = None  # NaN is not a point
        assert p.norms.keys() == want.keys()
        for k, v in want.items():
            assert p.norms[k] == (None if v is None else pytest.approx(v, rel=1e-5)), (p.step, k)
    assert t.points[5].norms == {}  # never validated: a mark, no point
    assert [p.step for p in trend.run_trend(open_catalog(url), RUN, last=2).points] == [5, 6]


def test_series_of_groups_by_role_and_moment():
    stats = [
        {"name": "model.w", "role": "parameter", "shape": [2, 2], "norm": 3.0},
        {"name": "model.b", "role": "parameter", "shape": [2], "norm": 4.0},
        {"name": "optimizer.state.0.exp_avg", "role": "optimizer_state", "shape": [2], "norm": 1.0},
        {"name": "optimizer.state.0.step", "role": "optimizer_state", "shape": [], "norm": 7.0},
        {"name": "optimizer.state.1.momentum_buffer", "role": "optimizer_state", "shape": [1], "norm": 2.0},
        {"name": "optimizer.state.1.exp_avg", "role": "optimizer_state", "shape": [1], "norm": None, "nan_count": 1},
        {"name": "model.running_mean", "role": "buffer", "shape": [2], "norm": 100.0},
    ]
    assert trend.series_of(stats) == {"parameters": 5.0, "optimizer exp_avg": None,
                                      "optimizer momentum_buffer": 2.0}


def test_plot_writes_a_png_and_an_svg_that_read_back(run, tmp_path, capsys):
    url, _ = run
    png, svg = tmp_path / "n.png", tmp_path / "sub" / "n.svg"
    assert main(["--catalog", url, "plot", RUN, "--out", str(png)]) == 0
    assert "6 checkpoints of tiny" in capsys.readouterr().out
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 500 and pixels.shape[1] > 800 and pixels[..., :3].std() > 0.05  # drawn, not blank
    assert main(["--catalog", url, "plot", RUN, "--out", str(svg)]) == 0
    text = " ".join(ET.parse(svg).getroot().itertext())
    for label in ("invalid step", "stale step", "corrupt step", "parameters", "optimizer exp_avg_sq"):
        assert label in text, label


def test_plot_errors(run, tmp_path, monkeypatch, capsys):
    url, _ = run
    assert main(["--catalog", url, "plot", "tinny", "--out", str(tmp_path / "x.png")]) == 1
    assert "did you mean" in capsys.readouterr().err
    assert main(["--catalog", url, "plot", RUN, "--out", str(tmp_path / "x.jpg")]) == 2
    assert "must end in .png or .svg" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["--catalog", url, "plot", RUN, "--out", str(tmp_path / "x.png")]) == 2
    assert "pip install 'safepoint[plot]'" in capsys.readouterr().err
    assert not list(tmp_path.glob("x.*"))


def test_markdown_shows_the_trend_and_the_marked_steps(run):
    url, _ = run
    md = trend.markdown(trend.run_trend(open_catalog(url), RUN))
    assert "| 3 | **invalid** |" in md and "| 6 | **corrupt** |" in md and "stale" in md
    spark = next(line for line in md.splitlines() if line.startswith("| optimizer exp_avg_sq |"))
    assert "·" in spark  # step 3's NaN second moment is a gap, not a point


def test_the_ingest_flows_verdict_artifact_ends_with_the_trend(run, prefect_api, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from safepoint.flows.ingest import ingest as ingest_flow
    from tests.helpers_ckpt import make_torch_save_ckpt

    url, _ = run
    make_torch_save_ckpt(tmp_path / "s7")
    commit(tmp_path / "s7", RUN, 7)
    ingest_flow(snapshot=str(tmp_path / "s7"), to=[(tmp_path / "durable").as_uri()], catalog_url=url)

    import anyio

    async def read():
        async with get_client() as client:
            key = ArtifactFilter(key=ArtifactFilterKey(any_=["validation-tiny-7"]))
            return await client.read_artifacts(artifact_filter=key)

    [art] = anyio.run(read)
    assert art.type == "markdown" and "# Norms of tiny" in art.data and "| 7 | verified |" in art.data
    assert "| 3 | **invalid** |" in art.data
