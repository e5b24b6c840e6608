"""eformer's `GCSPath.client` on a real GCS emulator (fake-gcs-server, the `gcs_emulator` fixture in conftest.py):
what the path writes the google-cloud-storage client reads, and the other way round."""
from __future__ import annotations

from eformer_nb.paths import GCSPath, ePath


def test_client_and_path_reach_the_same_objects(gcs_root, gcs_emulator):
    gcs_root.mkdir(parents=True)
    (gcs_root / "from_path.txt").write_text("written by ePath")
    client = gcs_root.client
    assert client.api_endpoint == gcs_emulator.url
    bucket = client.bucket(gcs_root.bucket)
    assert bucket.blob(f"{gcs_root.key}/from_path.txt").download_as_bytes() == b"written by ePath"
    bucket.blob(f"{gcs_root.key}/from_client.txt").upload_from_string(b"written by the client")
    assert (gcs_root / "from_client.txt").read_text() == "written by the client"
    names = sorted(b.name for b in client.list_blobs(gcs_root.bucket, prefix=gcs_root.key + "/"))
    # mkdir's directory placeholder (`key/`) is an object too, as the client sees it
    assert names == [f"{gcs_root.key}/", f"{gcs_root.key}/from_client.txt", f"{gcs_root.key}/from_path.txt"], names


def test_eformers_constructor_form(gcs_root, gcs_emulator):
    "`GCSPath(path, client=...)`: the path's own filesystem is built from the client (its endpoint and credentials)."
    gcs_root.mkdir(parents=True)
    client = gcs_root.client
    p = GCSPath(str(gcs_root / "via_client.txt"), client=client)
    assert p.client is client and p.fs is not gcs_root.fs
    p.write_text("through a path built from a client")
    assert client.bucket(p.bucket).blob(p.key).download_as_bytes() == b"through a path built from a client"
    assert ePath(str(gcs_root / "via_client.txt")).read_text() == "through a path built from a client"
