"""The admin API as an attacker on the loopback would use it: a path to any file, a FIFO, a NUL
byte, a symlink out of the config directory, a YAML bomb, a config nested past the parser; and
`GET /config` on a config whose URLs carry credentials."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]

SECRET_LINE = "root:$6$not-a-real-hash:19000:0:99999:7:::"


async def admin_of(start_edge, refresh_document, folder: Path) -> tuple[Any, dict[str, Any]]:
    """An Edge started from `folder/edge.yaml`, refreshes allowed from `folder/configs`."""
    (folder / "configs").mkdir()
    document = refresh_document()
    document["edge"]["admin"]["config_dir"] = str(folder / "configs")
    (folder / "edge.yaml").write_text(yaml.safe_dump(document))
    edge = await start_edge(document, config_path=folder / "edge.yaml")
    return edge, document


async def refresh(edge: Any, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=edge.admin_url, timeout=30) as admin:
        return await admin.post("/refresh", json={"mode": "dry_run", **body})


async def test_a_path_reads_only_the_edges_own_file_or_one_in_the_config_dir(
    start_edge, refresh_document, tmp_path: Path
) -> None:
    edge, document = await admin_of(start_edge, refresh_document, tmp_path)
    outside = tmp_path / "shadow"
    outside.write_text(SECRET_LINE + "\n")
    (tmp_path / "configs" / "link.yaml").symlink_to(outside)
    (tmp_path / "configs" / "notes.yaml").write_text(SECRET_LINE + "\n")
    (tmp_path / "configs" / "good.yaml").write_text(yaml.safe_dump(document))

    for path in (str(outside), "/etc/passwd", str(tmp_path / "configs" / "link.yaml")):
        answer = await refresh(edge, path=path)
        assert answer.status_code == 400, answer.text
        assert "a refresh reads only" in answer.json()["error"]["message"]
        assert SECRET_LINE not in answer.text

    # A file in the directory that is no config: one problem, nothing of its content.
    answer = await refresh(edge, path=str(tmp_path / "configs" / "notes.yaml"))
    assert answer.status_code == 422
    assert answer.json()["problems"] == [
        {"path": "", "message": "the file is not an EdgeConfig document (no edge section)"}
    ]
    assert "not-a-real-hash" not in answer.text

    # What is allowed works, by absolute or relative path, and so does the Edge's own file.
    for path in (str(tmp_path / "configs" / "good.yaml"), "good.yaml"):
        assert (await refresh(edge, path=path)).status_code == 200
    assert (await refresh(edge, path=str(tmp_path / "edge.yaml"))).status_code == 200
    assert (await refresh(edge)).status_code == 200


async def test_a_fifo_or_a_nul_byte_is_refused_at_once_and_later_refreshes_work(
    start_edge, refresh_document, tmp_path: Path
) -> None:
    edge, _ = await admin_of(start_edge, refresh_document, tmp_path)
    fifo = tmp_path / "configs" / "fifo.yaml"
    os.mkfifo(fifo)
    started = time.monotonic()
    answer = await refresh(edge, path=str(fifo))
    assert answer.status_code == 400
    assert "not a regular file" in answer.json()["error"]["message"]
    nul = await refresh(edge, path=str(tmp_path / "configs" / "a\x00b"))
    assert nul.status_code == 400
    assert "NUL" in nul.json()["error"]["message"]
    assert time.monotonic() - started < 10  # nothing blocked on the FIFO
    assert (await refresh(edge)).status_code == 200


@pytest.mark.parametrize(
    "config_yaml",
    [
        pytest.param(
            "a: &a [x,x,x,x,x,x,x,x,x]\n"
            + "".join(
                f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]\n"
                for p, c in zip("abcdefgh", "bcdefghi", strict=True)
            ),
            id="billion-laughs",
        ),
        pytest.param("a: " + "[" * 100_000, id="deep-flow"),
        pytest.param("- " * 20_000 + "x", id="deep-block"),
        pytest.param('{"edge": ' + "[" * 5000 + "]" * 5000 + "}", id="deep-json"),
    ],
)
async def test_hostile_config_text_is_refused_quickly_and_the_edge_lives_on(
    start_edge, refresh_document, config_yaml: str
) -> None:
    edge = await start_edge(refresh_document())
    started = time.monotonic()
    answer = await refresh(edge, config_yaml=config_yaml)
    assert answer.status_code == 422, answer.text
    assert time.monotonic() - started < 5
    assert (await refresh(edge, config=refresh_document())).status_code == 200


async def test_get_config_redacts_credentials_in_url_queries(
    start_edge, refresh_document, tmp_path: Path
) -> None:
    document = refresh_document()
    document["nodes"][1]["providers"][0]["adapter"] = {
        "type": "openai",
        "base_url": "https://user:pass@llm.example/v1?api_key=live-key-123&token=tok#frag",
    }
    edge = await start_edge(document)
    async with httpx.AsyncClient(base_url=edge.admin_url, timeout=30) as admin:
        shown = (await admin.get("/config")).json()
    url = shown["config"]["nodes"][1]["providers"][0]["adapter"]["base_url"]
    assert url == "https://<redacted>@llm.example/v1?api_key=<redacted>&token=<redacted>#<redacted>"
