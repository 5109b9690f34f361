"""ALOE's Python worker: an existing PyTorch training loop takes part in an ALOE job
(docs/python.md)."""

from aloe.client import Credentials, RpcError
from aloe.codec import CodecError
from aloe.data import Corpus, DataError
from aloe.model import TransformerLM
from aloe.worker import (Step, Task, Worker, WorkerError, layer_name_of, model_fingerprint,
                         param_groups)

__all__ = ["Corpus", "CodecError", "Credentials", "DataError", "RpcError", "Step", "Task",
           "TransformerLM", "Worker", "WorkerError", "layer_name_of", "model_fingerprint",
           "param_groups"]
