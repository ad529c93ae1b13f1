"""The image build's buildah command lines, run by the machine's own buildah (Debian's package).

A cached base or image never runs them again, so a flag that this buildah refuses hides until a
machine builds from nothing; here each runs on a storage of its own, on a few bytes.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from e2e.cluster import hostpackages
from e2e.cluster.imagebuild import DEBIAN_PACKAGES, STANDIN_LABEL, Buildah, import_standin


def test_a_stand_in_base_is_imported_with_its_label(tmp_path: Path) -> None:
    hostpackages.ensure_commands(DEBIAN_PACKAGES)
    context = tmp_path / "context"
    context.mkdir()
    with tarfile.open(context / "base.tar", "w") as tar:
        data = b"stand-in\n"
        member = tarfile.TarInfo("etc/iop-test")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    buildah = Buildah(tmp_path / "cache")
    try:
        # bookworm's buildah 1.28 refused the first command line: --force-rm without --layers.
        import_standin(buildah, "localhost/iop-standin-test:1", context, "k" * 16)
        assert buildah.image_id("localhost/iop-standin-test:1") is not None
        assert buildah.labels("localhost/iop-standin-test:1")[STANDIN_LABEL] == "k" * 16
    finally:
        buildah.succeeds("rmi", "--all", "--force")
