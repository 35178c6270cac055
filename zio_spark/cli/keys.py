"""``zio-spark keys``: print a new CURVE key pair (Z85)."""

from __future__ import annotations

import argparse

from zio_spark.cli.common import EXIT_OK, emit

__all__ = ["run_keys"]


def run_keys(args: argparse.Namespace) -> int:
    import zmq

    public, secret = zmq.curve_keypair()
    summary = {"public": public.decode("ascii"), "secret": secret.decode("ascii")}
    if args.json:
        emit(args, summary)
    else:
        print(f"public: {summary['public']}\nsecret: {summary['secret']}")
    return EXIT_OK
