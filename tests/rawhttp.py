"""HTTP over a plain socket, for request bodies no client library would send whole."""

from __future__ import annotations

import select
import socket


def post_huge(
    port: int,
    path: str,
    size: int,
    *,
    chunked: bool,
    chunk: int = 1 << 20,
    send_body: bool = True,
    timeout: float = 30,
) -> tuple[int, bytes, int]:
    """POST ``size`` bytes to ``path`` on 127.0.0.1, with a Content-Length or chunked,
    stopping as soon as an answer arrives. Returns (status, body, bytes of the body
    sent). Without ``send_body`` only the head goes out: the answer must come unread."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
        head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}{framing}\r\n\r\n".encode())
        block = b"x" * chunk
        sent = 0
        while send_body and sent < size:
            answered, _, _ = select.select([sock], [], [], 0)
            if answered:
                break
            n = min(chunk, size - sent)
            try:
                sock.sendall(f"{n:x}\r\n".encode() + block[:n] + b"\r\n" if chunked else block[:n])
            except (BrokenPipeError, ConnectionResetError):
                # the server answered and closed between the check and this send:
                # its answer is what is read next
                break
            sent += n
        if chunked and sent == size:
            sock.sendall(b"0\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            assert more, "the server closed the connection without an answer"
            data += more
        head_bytes, _, body = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            more = sock.recv(65536)
            assert more, "the answer was cut short"
            body += more
        return status, body, sent
