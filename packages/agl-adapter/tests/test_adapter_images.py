"""Images of a rollout's model calls, before any processor runs: loading URLs, and refusing rows
whose images nothing can encode."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from agl_adapter import InvalidImagesError, RolloutAdapter, load_image
from agl_testing.routes import succeeded_rollout
from agl_types import Triplet


def _png(tmp_path: Path) -> bytes:
    path = tmp_path / "red.png"
    Image.new("RGBA", (3, 2), (255, 0, 0, 128)).save(path)
    return path.read_bytes()


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        content_type = "image/png" if self.path == "/red.png" else "text/html"
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def image_server(tmp_path: Path) -> Iterator[str]:
    _ImageHandler.body = _png(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_images_load_as_rgb_from_data_file_and_loopback_http_urls(tmp_path: Path, image_server: str) -> None:
    png = _png(tmp_path)
    urls = [
        "data:image/png;base64," + base64.b64encode(png).decode(),
        f"file://{tmp_path / 'red.png'}",
        f"file://localhost{tmp_path / 'r%65d.png'}",
        f"{image_server}/red.png",
    ]
    for url in urls:
        image = load_image(url)
        assert (image.mode, image.size, image.getpixel((0, 0))) == ("RGB", (3, 2), (255, 0, 0)), url


def test_a_reply_that_is_not_an_image_and_unknown_schemes_are_refused(image_server: str) -> None:
    with pytest.raises(ValueError, match="content-type 'text/html', not an image"):
        load_image(f"{image_server}/page.html")
    with pytest.raises(ValueError, match=r"only data:, file:// and http\(s\):// image URLs"):
        load_image("ftp://127.0.0.1/red.png")
    with pytest.raises(ValueError, match="not base64"):
        load_image("data:image/png;base64,%%%")


def test_a_row_with_images_and_no_processor_is_an_error_naming_rollout_and_turn() -> None:
    triplets = [
        Triplet(prompt_token_ids=[1, 2], response_token_ids=[3]),
        Triplet(prompt_token_ids=[4, 5], response_token_ids=[6], image_urls=["data:a", "data:b"]),
    ]
    adapter = RolloutAdapter(
        max_prompt_length=4, max_response_length=4, pad_token_id=0, trace_aggregator_level="transition"
    )
    with pytest.raises(
        InvalidImagesError, match=r"rollout 'r1' turn 1 has 2 image\(s\) but the adapter has no processor"
    ):
        adapter.build_batch([succeeded_rollout(triplets)])


def test_text_rows_need_no_processor_and_keep_the_plain_layout() -> None:
    adapter = RolloutAdapter(max_prompt_length=3, max_response_length=2, pad_token_id=0)
    batch, _ = adapter.build_batch(
        [succeeded_rollout([Triplet(prompt_token_ids=[1, 2], response_token_ids=[3])])]
    )
    assert batch.multi_modal_inputs is None
    assert batch.position_ids.tolist() == [[0, 0, 1, 2, 2]]
    assert "multi_modal_inputs" not in batch.non_tensors()
