"""The gRPC calls of a worker (proto/coordinator_service.proto, proto/parameter_service.proto):
the control plane to the server or coordinator, Pull and Push to the server or to the shard
processes that own each layer. No retries here; worker.py decides what to retry."""

import concurrent.futures
import threading
import time

import grpc
import numpy as np

from aloe import codec as codecs
from aloe._proto import coordinator_pb2 as cpb
from aloe._proto import parameter_pb2 as ppb

CONTROL_DEADLINE = 30.0    # seconds, as aloe-worker
TRANSFER_DEADLINE = 600.0  # a pull or push of the whole model over a slow link

# The channel reconnects at most 1 s apart once a server is back (as aloe-worker).
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


class RpcError(RuntimeError):
    """A failed call: `code` is the grpc.StatusCode, the message names the call and server."""

    def __init__(self, code, message):
        super().__init__("%s: %s" % (code.name, message))
        self.code = code
        self.details = message


class Credentials:
    """What aloe-worker's --token_file and --tls_* flags give: an access token (sent as
    x-aloe-token), a CA for TLS, and optionally a client certificate and key (mutual TLS)."""

    def __init__(self, token="", tls_ca=None, tls_cert=None, tls_key=None, server_name=""):
        self.token = token
        self.tls_ca, self.tls_cert, self.tls_key = tls_ca, tls_cert, tls_key
        self.server_name = server_name

    @classmethod
    def from_files(cls, token_file="", tls_ca_file="", tls_cert_file="", tls_key_file="",
                   server_name=""):
        def read(path):
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()
        token = read(token_file)
        token = token.decode().split("\n", 1)[0].strip() if token else ""
        return cls(token, read(tls_ca_file), read(tls_cert_file), read(tls_key_file),
                   server_name)

    def channel(self, address):
        options = list(_CHANNEL_OPTIONS)
        if self.tls_ca is None:
            return grpc.insecure_channel(address, options=options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        creds = grpc.ssl_channel_credentials(self.tls_ca, self.tls_key, self.tls_cert)
        return grpc.secure_channel(address, creds, options=options)

    def metadata(self):
        return (("x-aloe-token", self.token),) if self.token else None


def _unary(channel, service, method, reply_type):
    return channel.unary_unary("/aloe.v1.%s/%s" % (service, method),
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=reply_type.FromString)


def _wrap(what, address, call):
    try:
        return call()
    except grpc.RpcError as e:
        raise RpcError(e.code(), "%s at %s: %s" % (what, address, e.details())) from None


class Client:
    """Channels to one server (and, once joined, to its shard processes). Thread-safe."""

    def __init__(self, address, credentials=None):
        self.address = address
        self.credentials = credentials or Credentials()
        self._lock = threading.Lock()
        self._states = {}  # id(channel) -> grpc.ChannelConnectivity
        self._channel = self._watch(self.credentials.channel(address))
        self._shards = []  # (address, channel) per shard process
        c = self._channel
        self._join = _unary(c, "Coordinator", "Join", cpb.JoinReply)
        self._heartbeat = _unary(c, "Coordinator", "Heartbeat", cpb.HeartbeatReply)
        self._request_task = _unary(c, "Coordinator", "RequestTask", cpb.Task)
        self._report_eval = _unary(c, "Coordinator", "ReportEval", cpb.EvalAck)
        self._leave = _unary(c, "Coordinator", "Leave", cpb.LeaveReply)

    def close(self):
        with self._lock:
            for _, channel in self._shards:
                channel.close()
            self._shards = []
        self._channel.close()

    def set_shards(self, addresses):
        """Pulls and pushes go to these shard processes (JoinReply.shard_addresses); none: to
        the server itself."""
        with self._lock:
            if [a for a, _ in self._shards] == list(addresses):
                return
            for _, channel in self._shards:
                channel.close()
            shards = [(a, self.credentials.channel(a)) for a in addresses]
        for _, channel in shards:
            self._watch(channel)
        with self._lock:
            self._shards = shards

    def _call(self, name, stub, request):
        return _wrap(name, self.address, lambda: stub(
            request, timeout=CONTROL_DEADLINE, metadata=self.credentials.metadata()))

    def join(self, request):
        return self._call("Join", self._join, request)

    def heartbeat(self, request):
        return self._call("Heartbeat", self._heartbeat, request)

    def request_task(self, request):
        return self._call("RequestTask", self._request_task, request)

    def report_eval(self, request):
        return self._call("ReportEval", self._report_eval, request)

    def leave(self, request):
        return self._call("Leave", self._leave, request)

    def _watch(self, channel):
        """Follows `channel`'s connectivity (for await_servers)."""
        def update(state, key=id(channel)):
            with self._lock:
                self._states[key] = state
        channel.subscribe(update, try_to_connect=True)
        return channel

    def await_servers(self, wait):
        """A retry's wait of `wait` seconds, which ends early once every connection that was
        down is back (a restarted server is asked at once)."""
        deadline = time.monotonic() + wait
        with self._lock:
            keys = [id(self._channel)] + [id(c) for _, c in self._shards]
            down = any(self._states.get(k) != grpc.ChannelConnectivity.READY for k in keys)
        if not down:
            time.sleep(wait)
            return
        while time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            with self._lock:
                if all(self._states.get(k) == grpc.ChannelConnectivity.READY for k in keys):
                    return

    def _targets(self):
        """[(index or None, address, channel)]: the server, or every shard process."""
        with self._lock:
            if not self._shards:
                return [(None, self.address, self._channel)]
            return [(i, a, c) for i, (a, c) in enumerate(self._shards)]

    def pull(self, worker_id, version, spec):
        """The layers of `version` as float32 numpy arrays, one per spec layer, checked chunk by
        chunk (one version, in-order offsets, the layer's size, finite values)."""
        layers = [np.empty(layer.num_elements, dtype=np.float32) for layer in spec.layers]
        filled = [0] * len(layers)
        request = ppb.PullRequest(worker_id=worker_id, version=version)

        def stream(target):
            index, address, channel = target
            call = channel.unary_stream("/aloe.v1.ParameterService/Pull",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=ppb.ParamChunk.FromString)

            def read():
                for chunk in call(request, timeout=TRANSFER_DEADLINE,
                                  metadata=self.credentials.metadata()):
                    layer = chunk.layer_id
                    bad = (chunk.version != version or layer >= len(layers) or
                           (index is not None and spec.layers[layer].shard != index) or
                           chunk.layer_elements != spec.layers[layer].num_elements or
                           chunk.offset != filled[layer] or len(chunk.data) % 4 or
                           filled[layer] + len(chunk.data) // 4 > layers[layer].size)
                    if bad:
                        raise RpcError(grpc.StatusCode.DATA_LOSS,
                                       "Pull at %s: bad chunk for layer %d" % (address, layer))
                    values = np.frombuffer(chunk.data, dtype="<f4")
                    if not np.isfinite(values).all():
                        raise RpcError(grpc.StatusCode.DATA_LOSS,
                                       "Pull at %s: layer %d holds NaN or Inf" % (address, layer))
                    layers[layer][filled[layer]:filled[layer] + values.size] = values
                    filled[layer] += values.size
            return _wrap("Pull", address, read)

        self._each_target(stream)
        for i, layer in enumerate(spec.layers):
            if filled[i] != layer.num_elements:
                raise RpcError(grpc.StatusCode.DATA_LOSS,
                               "Pull of version %d: layer %d incomplete" % (version, i))
        return layers

    def push(self, header, spec, deltas, layer_codecs, block_size, residuals=None):
        """Pushes one pseudo-gradient (one float32 array per spec layer) under `header`, every
        layer encoded with its codec; returns (PushReply, payload bytes). With `residuals`
        (error feedback), residuals[i] becomes what layer i's encoding lost. Everything is
        encoded before anything is sent: a value that cannot be encoded sends nothing."""
        targets = self._targets()
        streams = {index: [] for index, _, _ in targets}
        for layer, delta in enumerate(deltas):
            owner = spec.layers[layer].shard if targets[0][0] is not None else None
            codec = layer_codecs[layer]
            for offset, payload, residual in codecs.chunks(codec, delta, block_size):
                streams[owner].append(ppb.PushChunk(layer_id=layer, offset=offset, data=payload,
                                                    codec=codec))
                if residuals is not None:
                    residuals[layer][offset:offset + residual.size] = residual
        sent = sum(len(c.data) for chunks in streams.values() for c in chunks)

        def send(target):
            index, address, channel = target
            chunks = streams[index]
            if chunks:
                chunks[0].header.CopyFrom(header)
            else:
                chunks = [ppb.PushChunk(header=header)]
            call = channel.stream_unary("/aloe.v1.ParameterService/Push",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=ppb.PushReply.FromString)
            label = "Push" if index is None else "Push to shard %d" % index
            return _wrap(label, address, lambda: call(iter(chunks), timeout=TRANSFER_DEADLINE,
                                                      metadata=self.credentials.metadata()))

        replies = self._each_target(send)
        # The update's own reply is the one that completed it (staged = false).
        for reply in replies:
            if not reply.staged:
                return reply, sent
        return replies[0], sent

    def _each_target(self, fn):
        targets = self._targets()
        if len(targets) == 1:
            return [fn(targets[0])]
        with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
            futures = [pool.submit(fn, t) for t in targets]
            return [f.result() for f in futures]  # the first failure in shard order
