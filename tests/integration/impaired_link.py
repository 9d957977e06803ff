"""A network link with delay and packet loss between two network namespaces, in user space.

For kernels without ``netem`` (test_two_hosts.py uses it where it can). Each namespace
gets a TUN device, made by this process from inside that namespace, so the device lives
there and carries its IP packets to this process; every packet read from one device is
written to the other ``--delay-ms`` later, unless it is dropped, each one independently
with probability ``--loss``. Both directions alike, so a round trip takes twice the delay.
The kernels' TCP stacks see a real link: queued packets, lost segments, retransmissions.

    python tests/integration/impaired_link.py NS_A DEV_A NS_B DEV_B --delay-ms 20 --loss 0.01

Prints ``ready`` once both devices exist (the caller then gives them addresses and brings
them up), and on SIGTERM one JSON line per direction: packets carried, lost on purpose,
and undeliverable (written while the other device was not up yet, or its queue full).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import fcntl
import json
import os
import random
import signal
import struct

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000


def enter_namespace(name: str) -> None:
    """Move this (single-threaded) process into network namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def open_tun(device: str) -> int:
    """A TUN device named ``device`` in the current network namespace (IP packets, no
    header), gone when the returned descriptor is closed."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Link:
    def __init__(self, delay_s: float, loss: float, seed: int | None) -> None:
        self.delay_s = delay_s
        self.loss = loss
        self.rng = random.Random(seed)
        self.stats: dict[str, dict[str, int]] = {}

    def attach(self, loop: asyncio.AbstractEventLoop, src: int, dst: int, name: str) -> None:
        counts = self.stats[name] = {"carried": 0, "lost": 0, "undeliverable": 0}

        def send(packet: bytes) -> None:
            try:
                os.write(dst, packet)
                counts["carried"] += 1
            except OSError:  # the other device is not up (yet), or its queue is full
                counts["undeliverable"] += 1

        def receive() -> None:
            while True:
                try:
                    packet = os.read(src, 65536)
                except BlockingIOError:
                    return
                if self.rng.random() < self.loss:
                    counts["lost"] += 1
                elif self.delay_s > 0:
                    loop.call_later(self.delay_s, send, packet)
                else:
                    send(packet)

        loop.add_reader(src, receive)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ns_a")
    parser.add_argument("dev_a")
    parser.add_argument("ns_b")
    parser.add_argument("dev_b")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    enter_namespace(args.ns_a)
    fd_a = open_tun(args.dev_a)
    enter_namespace(args.ns_b)
    fd_b = open_tun(args.dev_b)
    link = Link(args.delay_ms / 1000, args.loss, args.seed)
    loop = asyncio.new_event_loop()
    link.attach(loop, fd_a, fd_b, f"{args.ns_a}->{args.ns_b}")
    link.attach(loop, fd_b, fd_a, f"{args.ns_b}->{args.ns_a}")
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    loop.add_signal_handler(signal.SIGINT, stop.set_result, None)
    print("ready", flush=True)
    loop.run_until_complete(stop)
    print(json.dumps(link.stats), flush=True)


if __name__ == "__main__":
    main()
