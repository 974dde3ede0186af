"""`pagemesh keys DIR [--process NAME ...]`: the CurveZMQ keys that encrypt and authenticate the
mesh's internal sockets (common/transport_curve.py).

Shared: `pagemesh keys DIR`, then every process starts with `--zmq-keys DIR` (or with
$PAGEMESH_ZMQ_KEYS=DIR; `pagemesh up` passes it to its children): a peer without the folder's
secret key cannot connect to any of them.

    DIR/mesh.key          the public key (ZeroMQ certificate format)
    DIR/mesh.key_secret   the public and the secret key: readable by its owner only

Per process: `pagemesh keys DIR --process scheduler tokenizer gateway prefill decode`, then each
process starts with `--zmq-keys DIR --zmq-key-name NAME` (or $PAGEMESH_ZMQ_KEY_NAME=NAME): it
connects with its own pair, and the binding sides admit only the public keys in DIR/allowed/ (the
mesh's pair, made too if missing, stays every binding side's server key). Run it again with new
names to add processes; delete DIR/allowed/NAME.key to shut one out.

    DIR/NAME.key, DIR/NAME.key_secret   a process's pair (the secret readable by its owner only)
    DIR/allowed/NAME.key                 its public key on the allow-list

Existing keys are never overwritten.
"""

from __future__ import annotations

import argparse
import sys

from pagemesh.common.transport_curve import KEY_NAME_ENV, KEYS_ENV, make_keys, make_process_keys


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="pagemesh keys", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", help="where to write the keys (made if missing; existing keys are kept)")
    parser.add_argument(
        "--process",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="a keypair of its own for each process NAME, on the allow-list DIR/allowed/ (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        written = make_process_keys(args.folder, args.process) if args.process else list(make_keys(args.folder))
    except (FileExistsError, OSError, ValueError) as e:
        print(f"pagemesh keys: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print("wrote " + ", ".join(written))
    if args.process:
        print(f"start each process with --zmq-keys {args.folder} --zmq-key-name NAME")
        print(f"(or {KEYS_ENV}={args.folder} {KEY_NAME_ENV}=NAME); the mesh admits the keys in {args.folder}/allowed/")
    else:
        print(f"start every process with --zmq-keys {args.folder} (or {KEYS_ENV}={args.folder})")
