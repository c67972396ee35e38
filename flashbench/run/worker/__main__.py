"""Entry point of a worker process: `<sandbox boot> flashbench.run.worker READ_FD WRITE_FD FD_SOCKET`
(FD_SOCKET: its end of the socket on which a CPU job's arena descriptor comes)."""

import os
import socket
import sys

import torch

from ..protocol import Channel, Setup, Stop, parse_request
from ..recipe import CPU_THREADS
from .handler import Worker


def main(read_fd: int, write_fd: int, fd_socket: int) -> None:
    channel = Channel(read_fd, write_fd)
    setup = parse_request(channel.receive_json())
    if not isinstance(setup, Setup):
        sys.exit("the first message must be a setup")
    if torch.device(setup.device).type == "cpu":  # timed as the judge times the steps (run/recipe.py)
        torch.set_num_threads(CPU_THREADS)
    worker = Worker(setup, socket.socket(fileno=fd_socket))
    while True:
        request = parse_request(channel.receive_json())
        if isinstance(request, Stop):
            # The interpreter's exit (a last collection over everything torch made at import, the teardown of
            # its modules) took 0.2-0.5 s of CPU while the judge waited for it, once per worker; nothing in it
            # is the judge's: the process ends at once (its buffered output still goes to the log).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        channel.send(worker.handle(request))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
