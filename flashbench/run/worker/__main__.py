"""Entry point of a worker process: `<sandbox boot> flashbench.run.worker READ_FD WRITE_FD`."""

import sys

from ..protocol import Channel, Setup, Stop, parse_request
from .handler import Worker


def main(read_fd: int, write_fd: int) -> None:
    channel = Channel(read_fd, write_fd)
    setup = parse_request(channel.receive_json())
    if not isinstance(setup, Setup):
        sys.exit("the first message must be a setup")
    worker = Worker(setup)
    while True:
        request = parse_request(channel.receive_json())
        if isinstance(request, Stop):
            return
        channel.send(worker.handle(request))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
