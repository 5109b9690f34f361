"""A PyTorch training loop as an ALOE worker: join, take tasks, load the base version into a
torch.nn.Module, push the pseudo-gradient, heartbeat with the measured speed, leave; with the
retries of aloe-worker (docs/python.md).

    worker = aloe.Worker("server:50051", corpus_dir="data/sotu")
    model = aloe.TransformerLM(worker.model_config)
    optimizer = torch.optim.AdamW(aloe.param_groups(model, worker.inner["weight_decay"]), ...)
    for task in worker.tasks():
        worker.load(model, task)
        for step in task.steps():
            for group in optimizer.param_groups:
                group["lr"] = step.lr
            loss = model.loss(task.batch())
            ...backward, clip, optimizer.step()...
            task.record(loss)
        worker.push(model, task)
"""

import logging
import os
import random
import socket
import threading
import time

import grpc
import numpy as np
import torch

from aloe import codec as codecs
from aloe import data as corpus
from aloe import schedule
from aloe._proto import coordinator_pb2 as cpb
from aloe._proto import parameter_pb2 as ppb
from aloe.client import Client, RpcError

log = logging.getLogger("aloe.worker")

_LOSS, _LOGITS = 1, 2  # ModelOutput


class WorkerError(RuntimeError):
    """The run cannot go on (a refusal that retrying cannot mend, or the server gone for longer
    than connect_timeout)."""


def _fnv1a64(text):
    h = 14695981039346656037
    for byte in text.encode():
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def layer_name_of(parameter):
    """The layer a parameter belongs to (common/imported_model.h): "blocks.3" for
    "blocks.3.attn.weight", "embed" for "embed.weight", "root" for "scale"."""
    parts = parameter.split(".")
    if len(parts) == 1:
        return "root"
    if len(parts) > 2 and parts[1].isdigit():
        return parts[0] + "." + parts[1]
    return parts[0]


def model_fingerprint(module, output="loss"):
    """The fingerprint aloe-import-model gives the TorchScript form of `module` (its layers'
    names and its tensors' names and shapes), which a server training that model expects at
    Join. output: "loss" (forward(inputs, targets) -> loss) or "logits"."""
    layers = {}
    for name, p in module.named_parameters():
        layers.setdefault(layer_name_of(name), []).append((name, tuple(p.shape)))
    text = "output=%s;" % ("MODEL_OUTPUT_LOSS" if output == "loss" else "MODEL_OUTPUT_LOGITS")
    for layer, tensors in layers.items():
        text += "layer=%s:" % layer
        for name, shape in tensors:
            text += "%s[%s];" % (name, ",".join(str(d) for d in shape))
    return "byo1-%016x" % _fnv1a64(text)


def param_groups(module, weight_decay):
    """AdamW groups as aloe-worker's: weight decay on matrices (embeddings, linear weights)
    only, not on biases and LayerNorm parameters."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    other = [p for p in module.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": other, "weight_decay": 0.0}]


class Step:
    """One local step of a task: its index in the task and its learning rate."""

    def __init__(self, index, lr):
        self.index = index
        self.lr = lr


class Task:
    """A TRAIN task: where its data comes from, how long it runs, its LR schedule position.

    task.steps() yields Step objects until local_steps are done, the task's wall-clock budget
    (A-EDiT) is spent at a step end, or the worker is asked to stop; task.batch() samples a
    batch of the task's data shard; task.record(loss) records a step's loss."""

    def __init__(self, proto, worker):
        self.proto = proto
        self.id = proto.task_id
        self.base_version = proto.base_version
        self.shard_name = proto.shard_name
        self.shard_file = proto.shard_file
        self.local_steps = proto.local_steps
        self.lr_step = proto.lr_step
        self.seed = proto.seed
        self.time_budget_seconds = proto.time_budget_seconds
        self._worker = worker
        self._rng = np.random.default_rng(proto.seed)
        self.steps_done = 0
        self.losses = []
        self.train_seconds = 0.0
        self.base = None  # the pulled layers, set by Worker.load

    def steps(self):
        inner = self._worker.inner
        start = time.monotonic()
        for i in range(self.local_steps):
            if self._worker.stopping:
                break
            yield Step(i, schedule.learning_rate(inner, self.lr_step + i))
            self.steps_done = i + 1
            self.train_seconds = time.monotonic() - start
            if self.time_budget_seconds > 0 and self.train_seconds >= self.time_budget_seconds:
                break

    def batch(self, batch_size=None):
        tokens = self._worker.corpus.tokens(self.shard_file)
        return corpus.sample_batch(tokens, batch_size or self._worker.inner["batch_size"],
                                   self._worker.model_config.seq_len, self._rng)

    def record(self, loss):
        self.losses.append(float(loss))

    @property
    def tokens(self):
        worker = self._worker
        return self.steps_done * worker.inner["batch_size"] * worker.model_config.seq_len


class Worker:
    """One worker of an ALOE job (a trainer). Not thread-safe: one training loop drives it.

    server: the server's (or coordinator's) address. corpus_dir: the job's prepared corpus, as
    aloe-worker --corpus_dir. model: for a bring-your-own model (a server with model_file),
    the module, whose fingerprint is sent at Join; None for the built-in transformer.
    codec: "fp32", "bf16" or "int8" for every layer instead of the server's transport, and
    error_feedback likewise (None: as the server says)."""

    def __init__(self, server, corpus_dir, name=None, credentials=None, model=None,
                 output="loss", codec=None, error_feedback=None, connect_timeout=60.0,
                 join_wait=600.0, retry_initial=0.25, retry_max=5.0, retry_jitter=0.5):
        self.name = name or "python-%s-%d" % (socket.gethostname(), os.getpid())
        self.client = Client(server, credentials)
        self.corpus = corpus.Corpus(corpus_dir)
        self.fingerprint = model_fingerprint(model, output) if model is not None else ""
        if codec is not None and codec not in codecs.NAMES:
            raise ValueError("codec %r: choose fp32, bf16 or int8" % codec)
        self._codec_override = codecs.NAMES.get(codec) if codec else None
        self._ef_override = error_feedback
        self.connect_timeout = connect_timeout
        self.join_wait = join_wait
        self._retry = (retry_initial, retry_max, retry_jitter)
        self._random = random.Random(os.getpid())
        self.stopping = False
        self.joined = None
        self._next_task = None
        self._given_up = 0
        self._update_id = 0
        self._residuals = None
        self._speed = 0.0
        self._lease_lost = threading.Event()
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread = None
        self.rounds = 0
        self.pushed_bytes = 0
        self.join()

    # ---- membership -----------------------------------------------------------------------

    @property
    def worker_id(self):
        return self.joined.worker_id

    @property
    def model_config(self):
        """The server's TransformerConfig (vocab_size and seq_len only for a model file)."""
        return self.joined.model

    @property
    def spec(self):
        return self.joined.model_spec

    def join(self):
        request = cpb.JoinRequest(name=self.name, role=cpb.ROLE_TRAINER, num_threads=1,
                                  model_fingerprint=self.fingerprint)
        give_up = time.monotonic() + self.join_wait
        while True:
            try:
                joined = self._with_retries("join", lambda: self.client.join(request))
                break
            except RpcError as e:
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > give_up:
                    raise WorkerError("joining %s: %s" % (self.client.address, e)) from None
                log.warning("the server has no room for this worker yet (%s); asking again",
                            e.details)
                time.sleep(5.0)
        if joined.layer_groups:
            raise WorkerError("the server synchronizes layer groups (partial_sync), which the "
                              "Python worker does not support")
        self.joined = joined
        self.inner = schedule.fill_defaults(joined.inner_optimizer)
        self.client.set_shards(list(joined.shard_addresses))
        transport = joined.transport
        self.block_size = transport.int8_block_size or codecs.INT8_DEFAULT_BLOCK_SIZE
        self.layer_codecs = []
        for layer in joined.model_spec.layers:
            c = transport.codec or codecs.FP32
            for o in transport.layer_codecs:
                if o.layer == layer.name:
                    c = o.codec
            if self._codec_override is not None:
                c = self._codec_override
            if c not in (codecs.FP32, codecs.BF16, codecs.INT8):
                raise WorkerError("layer %s is pushed as %s, which the Python worker does not "
                                  "encode (fp32, bf16, int8): pass codec=" %
                                  (layer.name, codecs.codec_name(c)))
            self.layer_codecs.append(c)
        self.error_feedback = (transport.error_feedback if self._ef_override is None
                               else self._ef_override)
        self._residuals = None
        self._next_task = None
        self._given_up = 0
        self._lease_lost.clear()
        self._start_heartbeat(joined.lease_seconds)
        log.info("%s joined as worker %d at version %d%s", self.name, joined.worker_id,
                 joined.version, " (%d shard processes)" % len(joined.shard_addresses)
                 if joined.shard_addresses else "")

    def _start_heartbeat(self, lease_seconds):
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join()
        self._heartbeat_stop = threading.Event()
        period = max(0.05, lease_seconds / 3)
        worker_id = self.joined.worker_id

        def beat(stop):
            while not stop.wait(period):
                try:
                    self.client.heartbeat(cpb.HeartbeatRequest(worker_id=worker_id,
                                                               steps_per_second=self._speed))
                except RpcError as e:
                    if e.code == grpc.StatusCode.NOT_FOUND:
                        self._lease_lost.set()
                        return
        self._heartbeat_thread = threading.Thread(target=beat, args=(self._heartbeat_stop,),
                                                  daemon=True, name="aloe-heartbeat")
        self._heartbeat_thread.start()

    def leave(self):
        self._heartbeat_stop.set()
        if self.joined is None:
            return
        try:
            self.client.leave(cpb.LeaveRequest(worker_id=self.joined.worker_id))
        except RpcError as e:
            log.warning("leave: %s", e)
        self.joined = None

    def close(self):
        self.leave()
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stop(self):
        """Ends the current task at its next step end (its steps are pushed), then the run
        (e.g. from a SIGTERM handler)."""
        self.stopping = True

    # ---- tasks ----------------------------------------------------------------------------

    def tasks(self):
        """Yields TRAIN tasks until the server says training is over or stop() was called;
        then leaves. Joins again when the server lost this worker (a restart, a lost lease)."""
        try:
            while not self.stopping:
                if self._lease_lost.is_set():
                    log.warning("a heartbeat found this worker's lease lost; joining again")
                    self.join()
                    continue
                try:
                    proto = self._request_task()
                except RpcError as e:
                    if e.code == grpc.StatusCode.NOT_FOUND:
                        log.warning("%s; joining again", e.details)
                        self.join()
                        continue
                    if self.stopping:
                        break
                    raise WorkerError(str(e)) from None
                if proto.kind == cpb.Task.WAIT:
                    continue
                if proto.kind == cpb.Task.STOP:
                    log.info("server says training is over")
                    break
                if proto.kind != cpb.Task.TRAIN:
                    raise WorkerError("a trainer got task kind %d" % proto.kind)
                yield Task(proto, self)
        finally:
            self.leave()

    def _request_task(self):
        if self._next_task is not None and not self._given_up:
            task, self._next_task = self._next_task, None
            return task
        self._next_task = None
        request = cpb.TaskRequest(worker_id=self.joined.worker_id, dropped_task_id=self._given_up)
        task = self._with_retries("request", lambda: self.client.request_task(request))
        self._given_up = 0
        return task

    def load(self, module, task):
        """Pulls the task's base version into the module's parameters (matched to the server's
        model spec by name and shape; the optimizer's state is untouched) and keeps it as the
        base of the pseudo-gradient. Returns False when the task was dropped (its base version
        is gone, or the server lost this worker): skip it, tasks() goes on."""
        try:
            task.base = self._with_retries("pull", lambda: self.client.pull(
                self.joined.worker_id, task.base_version, self.spec))
        except RpcError as e:
            return self._drop(task, e)
        self.set_parameters(module, task.base)
        try:  # this worker holds the base version now: the server need not keep it for it
            self.client.heartbeat(cpb.HeartbeatRequest(worker_id=self.joined.worker_id,
                                                       pulled_task_id=task.id))
        except RpcError as e:
            log.warning("could not report task %d's base version as pulled: %s", task.id, e)
        return True

    def set_parameters(self, module, layers):
        """Copies `layers` (one flat float32 array per spec layer, as Client.pull returns
        them) into the module's parameters, checked against the spec by name and shape."""
        self._check_module(module)
        with torch.no_grad():
            for p, values in zip(module.parameters(), self._tensors(layers)):
                p.copy_(torch.from_numpy(values).view(p.shape))

    def push(self, module, task):
        """Pushes base - current (the pseudo-gradient) of the task's steps. Returns the
        PushReply, or None when the push was refused (a stale or ended task; logged) and the
        task dropped."""
        if task.base is None:
            raise WorkerError("push of task %d before load" % task.id)
        if task.steps_done == 0:
            return None
        deltas = []
        for base, current in zip(task.base, self._layers(module)):
            deltas.append(base - current)
        if self.error_feedback:
            if self._residuals is None:
                self._residuals = [np.zeros_like(d) for d in deltas]
            for d, r in zip(deltas, self._residuals):
                d += r
        self._update_id += 1
        header = ppb.PushHeader(
            worker_id=self.joined.worker_id, task_id=task.id, update_id=self._update_id,
            base_version=task.base_version, steps_done=task.steps_done,
            tokens_learned=task.tokens,
            train_loss=float(np.mean(task.losses)) if task.losses else 0.0,
            compute_seconds=task.train_seconds, codec=codecs.FP32, want_next_task=True)
        if task.train_seconds > 0:
            self._speed = task.steps_done / task.train_seconds
        try:
            reply, sent = self._with_retries("push", lambda: self.client.push(
                header, self.spec, deltas, self.layer_codecs, self.block_size,
                self._residuals if self.error_feedback else None))
        except RpcError as e:
            self._drop(task, e)
            return None
        self.rounds += 1
        self.pushed_bytes += sent
        if reply.HasField("next_task"):
            self._next_task = reply.next_task
        log.info("task %d: %d steps, loss %.4f, pushed %d bytes; version %d (staleness %d)",
                 task.id, task.steps_done, header.train_loss, sent, reply.version,
                 reply.staleness)
        return reply

    # ---- internals ------------------------------------------------------------------------

    def _check_module(self, module):
        names = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
        want = [(t.name, tuple(t.shape)) for layer in self.spec.layers for t in layer.tensors]
        if names != want:
            for i, (got, exp) in enumerate(zip(names + [None] * len(want),
                                               want + [None] * len(names))):
                if got != exp:
                    raise WorkerError("model parameter %d is %s but the server's model has %s" %
                                      (i, got, exp))
        for n, p in module.named_parameters():
            if p.dtype != torch.float32:
                raise WorkerError("model parameter %s is %s, not float32" % (n, p.dtype))

    def _tensors(self, layers):
        """The spec's tensors, in order, as views of the flat layers."""
        for layer, values in zip(self.spec.layers, layers):
            offset = 0
            for t in layer.tensors:
                n = int(np.prod(t.shape))
                yield values[offset:offset + n]
                offset += n

    def _layers(self, module):
        params = [p.detach().to("cpu", torch.float32).reshape(-1).numpy()
                  for p in module.parameters()]
        out, i = [], 0
        for layer in self.spec.layers:
            k = len(layer.tensors)
            out.append(np.concatenate(params[i:i + k]) if k > 1 else params[i].copy())
            i += k
        return out

    def _drop(self, task, error):
        """A task that failed on `error`: dropped (returns False) or the run ends."""
        code = error.code
        if code == grpc.StatusCode.NOT_FOUND:
            log.warning("task %d dropped: %s; joining again", task.id, error.details)
            self.join()
            return False
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            log.warning("task %d dropped: %s", task.id, error.details)
            self._given_up = task.id
            return False
        if code == grpc.StatusCode.UNAVAILABLE:
            log.warning("task %d dropped: the server is away (%s)", task.id, error.details)
            return False
        raise WorkerError("task %d: %s" % (task.id, error)) from None

    def _with_retries(self, kind, call):
        """Repeats call while it fails UNAVAILABLE, up to connect_timeout (or stop()), waiting
        jittered exponential backoff from retry_initial to retry_max; returns its result."""
        initial, cap, jitter = self._retry
        give_up = time.monotonic() + self.connect_timeout
        failures = 0
        while True:
            try:
                return call()
            except RpcError as e:
                if (e.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > give_up or
                        self.stopping):
                    raise
                failures += 1
                wait = min(cap, initial * 2 ** (failures - 1))
                wait *= 1 - jitter * self._random.random()
                if failures == 1 or failures % 10 == 0:
                    log.warning("%s: %s; retrying (%d)", kind, e.details, failures)
                # A server that comes back is asked at once.
                self.client.await_servers(wait)
