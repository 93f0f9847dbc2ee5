"""`block:` destinations stay usable (issue 37).

`ingest --to block:NAME/folder` used to record only `s3://bucket/folder`, so restore, verify, scrub
and reconcile never used the block's endpoint and keys again (with default AWS credentials they
would read, and repair into, a same-named bucket at the default endpoint). The catalog now records
`block://NAME/folder/RUN/STEP`, and every later operation opens it through the block. Against
SeaweedFS with the block saved in a real Prefect server, and no AWS variable in the environment.
"""

from __future__ import annotations

import json
import shutil

import pytest

from safepoint.core.errors import UsageError
from safepoint.destinations import block_url
from tests.test_prefect_native import AWS_VARS, cli, client_env, save_bucket_block, server, snapshot  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.s3]


@pytest.mark.parametrize(("ref", "url"), [
    ("block:b", "block://b"), ("block:b/ckpt", "block://b/ckpt"), ("block:b//ckpt/x/", "block://b/ckpt/x"),
    ("block://b/ckpt", "block://b/ckpt"), ("block:///b/ckpt", "block://b/ckpt"),
])
def test_a_block_reference_has_one_form(ref, url):
    assert block_url(ref) == url


@pytest.mark.parametrize("ref", ["block:", "block://", "block:///"])
def test_a_block_reference_names_a_block(ref):
    with pytest.raises(UsageError, match="give a block name"):
        block_url(ref)


def test_a_block_destination_is_restored_verified_and_reconciled_through_its_block(client_env, s3_env,  # noqa: F811
                                                                                  tmp_path):
    prefect = client_env
    name = save_bucket_block(s3_env)
    home, cat = tmp_path / "home", f"sqlite:///{tmp_path / 'catalog.db'}"

    def sp(*args: str):
        return cli(prefect, home, "--catalog", cat, *args, drop_aws=AWS_VARS)

    folder = snapshot(tmp_path / "nvme", "blk", 3)
    original = {p.name: p.read_bytes() for p in folder.iterdir()}
    r = sp("ingest", str(folder), "--to", f"block:{name}/ckpt", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    replica = f"block://{name}/ckpt/blk/3"
    assert [x["url"] for x in json.loads(r.stdout)["replicas"]] == [replica]  # the block, not its bucket
    keys = [o["Key"] for o in s3_env.server.client().list_objects_v2(
        Bucket=s3_env.bucket, Prefix=f"{s3_env.prefix}/ckpt/blk/3/")["Contents"]]
    assert any(k.endswith("model.safetensors") for k in keys)
    r = sp("ls", "--json")
    assert r.returncode == 0 and replica in r.stdout, r.stdout + r.stderr

    shutil.rmtree(folder)  # the node is gone: only the block's bucket holds the checkpoint
    r = sp("restore", "--run", "blk", "--into", str(tmp_path / "resume"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "resume").iterdir() if p.name in original} == original
    for given in (replica, f"block:{name}/ckpt/blk/3"):
        r = sp("verify", given)
        assert r.returncode == 0 and "verified" in r.stdout, r.stdout + r.stderr
    r = sp("reconcile", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    r = sp("scrub", "--subset", "1", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    r = sp("ls", "--json")
    (row,) = json.loads(r.stdout)
    assert row["state"] == "verified" and [x["state"] for x in row["replicas"]] == ["verified"], r.stdout
