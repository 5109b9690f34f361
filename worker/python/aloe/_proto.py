"""The ALOE wire messages (proto/*.proto) as Python modules.

protoc (Debian's protobuf-compiler, the version of python3-protobuf) compiles the repository's
proto files on first use into a cache directory keyed by their contents, under the package
name ``aloe_v1_pb``, so that generated module names cannot collide with the user's own modules.
ALOE_PROTO_DIR names another proto directory (default: the repository's proto/ beside this
package); ALOE_CACHE_DIR another cache directory (default: ~/.cache/aloe).
"""

import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

_PACKAGE = "aloe_v1_pb"
_FILES = ("model", "codec", "config", "checkpoint", "coordinator_service",
          "parameter_service", "shard_protocol")
_IMPORT = re.compile(r'^(import\s+(?:public\s+)?")([a-z_]+\.proto)(";)', re.MULTILINE)


class ProtoError(RuntimeError):
    """The proto files could not be found or compiled."""


def _proto_dir():
    explicit = os.environ.get("ALOE_PROTO_DIR")
    if explicit:
        return explicit
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "..", "proto"))


def _compile(src_dir, out_root):
    """Compiles the proto files of src_dir into out_root/aloe_v1_pb (atomically)."""
    protoc = shutil.which("protoc")
    if protoc is None:
        raise ProtoError("protoc not found: install Debian's protobuf-compiler "
                         "(scripts/install-deps.sh installs it)")
    os.makedirs(out_root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".build-", dir=out_root)
    try:
        staged = os.path.join(work, "src", _PACKAGE)
        os.makedirs(staged)
        for name in _FILES:
            with open(os.path.join(src_dir, name + ".proto"), encoding="utf-8") as f:
                text = f.read()
            # Imports name the package directory, so that the generated modules import each
            # other as aloe_v1_pb.<name>_pb2.
            text = _IMPORT.sub(lambda m: m.group(1) + _PACKAGE + "/" + m.group(2) + m.group(3),
                               text)
            with open(os.path.join(staged, name + ".proto"), "w", encoding="utf-8") as f:
                f.write(text)
        out = os.path.join(work, "out")
        os.makedirs(out)
        sources = [os.path.join(_PACKAGE, n + ".proto") for n in _FILES]
        run = subprocess.run([protoc, "-I", os.path.join(work, "src"), "--python_out", out] +
                             sources, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise ProtoError("protoc failed on %s: %s" % (src_dir, run.stderr.strip()))
        with open(os.path.join(out, _PACKAGE, "__init__.py"), "w", encoding="utf-8"):
            pass
        target = os.path.join(out_root, _PACKAGE)
        try:
            os.rename(os.path.join(out, _PACKAGE), target)
        except OSError:
            if not os.path.isdir(target):  # another process won the race: use its copy
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load():
    src_dir = _proto_dir()
    digest = hashlib.sha256()
    try:
        for name in _FILES:
            with open(os.path.join(src_dir, name + ".proto"), "rb") as f:
                digest.update(f.read())
    except OSError as e:
        raise ProtoError("the ALOE proto files are not at %s (%s); set ALOE_PROTO_DIR to the "
                         "repository's proto/ directory" % (src_dir, e)) from e
    cache = os.environ.get("ALOE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "aloe")
    out_root = os.path.join(cache, "proto-" + digest.hexdigest()[:16])
    if not os.path.isfile(os.path.join(out_root, _PACKAGE, "__init__.py")):
        _compile(src_dir, out_root)
    if out_root not in sys.path:
        sys.path.insert(0, out_root)
    coordinator = importlib.import_module(_PACKAGE + ".coordinator_service_pb2")
    parameters = importlib.import_module(_PACKAGE + ".parameter_service_pb2")
    codec = importlib.import_module(_PACKAGE + ".codec_pb2")
    model = importlib.import_module(_PACKAGE + ".model_pb2")
    config = importlib.import_module(_PACKAGE + ".config_pb2")
    return coordinator, parameters, codec, model, config


coordinator_pb2, parameter_pb2, codec_pb2, model_pb2, config_pb2 = _load()
