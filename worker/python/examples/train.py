#!/usr/bin/python3
"""A PyTorch training loop that takes part in an ALOE job as a worker: it trains the server's
built-in transformer (aloe.TransformerLM) with its own AdamW, whose state stays across rounds,
on the job's corpus, and pushes each round's pseudo-gradient.

    PYTHONPATH=worker/python worker/python/examples/train.py \\
        --server 127.0.0.1:50051 --corpus_dir data/sotu

The loop between "for task" and "worker.push" is ordinary PyTorch: put your own model and step
there (for a bring-your-own model, pass model= to aloe.Worker so that it sends its
fingerprint). docs/python.md explains every call.
"""

import argparse
import logging
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import aloe  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="the server's address, HOST:PORT")
    parser.add_argument("--corpus_dir", required=True,
                        help="the job's prepared corpus (as aloe-worker --corpus_dir)")
    parser.add_argument("--name", default=None, help="this worker's name in the job")
    parser.add_argument("--codec", choices=["fp32", "bf16", "int8"], default=None,
                        help="push every layer with this codec (default: as the server says)")
    parser.add_argument("--error_feedback", choices=["on", "off"], default=None,
                        help="keep what the codec loses for the next push (default: as the "
                        "server says)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--token_file", default="", help="file whose first line is the token")
    parser.add_argument("--tls_ca_file", default="", help="PEM CA of the server certificate")
    parser.add_argument("--tls_cert_file", default="", help="PEM client certificate (mTLS)")
    parser.add_argument("--tls_key_file", default="", help="PEM client key (mTLS)")
    parser.add_argument("--tls_server_name", default="", help="name to verify in the "
                        "server certificate")
    parser.add_argument("--connect_timeout", type=float, default=60.0,
                        help="seconds to keep retrying a server that is away")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    credentials = aloe.Credentials.from_files(args.token_file, args.tls_ca_file,
                                              args.tls_cert_file, args.tls_key_file,
                                              args.tls_server_name)
    ef = None if args.error_feedback is None else args.error_feedback == "on"
    try:
        worker = aloe.Worker(args.server, args.corpus_dir, name=args.name,
                             credentials=credentials, codec=args.codec, error_feedback=ef,
                             connect_timeout=args.connect_timeout)
    except (aloe.WorkerError, aloe.DataError) as e:
        print("train.py: %s" % e, file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())

    model = aloe.TransformerLM(worker.model_config)
    inner = worker.inner
    optimizer = torch.optim.AdamW(aloe.param_groups(model, inner["weight_decay"]),
                                  lr=inner["lr"], betas=(inner["beta1"], inner["beta2"]),
                                  eps=inner["eps"])
    tokens, start = 0, time.monotonic()
    try:
        with worker:
            for task in worker.tasks():
                if not worker.load(model, task):
                    continue
                for step in task.steps():
                    for group in optimizer.param_groups:
                        group["lr"] = step.lr
                    loss = model.loss(task.batch())
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if inner["grad_clip"] > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), inner["grad_clip"])
                    optimizer.step()
                    task.record(loss.item())
                worker.push(model, task)
                tokens += task.tokens
    except (aloe.WorkerError, aloe.DataError) as e:
        print("train.py: %s" % e, file=sys.stderr)
        return 1
    seconds = time.monotonic() - start
    print("train.py: %d rounds, %d tokens in %.1f s (%.0f tokens/s), %d bytes pushed" %
          (worker.rounds, tokens, seconds, tokens / max(seconds, 1e-9), worker.pushed_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
