"""`pagemesh keys DIR`: the CurveZMQ keypair that encrypts and authenticates the mesh's internal
sockets (common/transport_curve.py). Every process then starts with `--zmq-keys DIR` (or with
$PAGEMESH_ZMQ_KEYS=DIR; `pagemesh up` passes it to its children): a peer without the folder's
secret key cannot connect to any of them.

    DIR/mesh.key          the public key (ZeroMQ certificate format)
    DIR/mesh.key_secret   the public and the secret key: readable by its owner only
"""

from __future__ import annotations

import argparse
import sys

from pagemesh.common.transport_curve import KEYS_ENV, make_keys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="pagemesh keys", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", help="where to write the keypair (made if missing; existing keys are kept)")
    args = parser.parse_args(argv)
    try:
        public, secret = make_keys(args.folder)
    except (FileExistsError, OSError) as e:
        print(f"pagemesh keys: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"wrote {public} and {secret}")
    print(f"start every process with --zmq-keys {args.folder} (or {KEYS_ENV}={args.folder})")
