"""A replica's request/reply link to what serves beside shard 0 on the coordinator port
(Sandblaster's coordinator, the data dispenser): one request at a time, asked again on a
fresh connection after 5 s without an answer, never given up (the helper is shard 0's,
and a replica has nothing else to do until it answers)."""

from __future__ import annotations

import threading

from distbelief.runtime import errors
from distbelief.runtime.transport import fanout, interface, zmq_transport
from distbelief.runtime.wire import protocol
from distbelief.runtime.wire.protocol import Header, OpSpec, Payload, Status

ASK_POLICY = fanout.RetryPolicy(attempt=5.0, give_up=None, resend_on_disconnect=False)


class ChiefPortLink:
    def __init__(self, address: str, *, who: str, worker_id: int, layout: int, security: dict | None,
                 stop: threading.Event, transport_: interface.Transport | None = None) -> None:
        self.worker_id, self.layout, self.stop = worker_id, layout, stop
        self._transport = transport_ or zmq_transport.default()
        self._link = self._transport.link(address, security, watch=False)
        self._name = f"{who} at {address}"
        self._seq = 0

    def request(self, op: OpSpec, meta: Payload | None, reply: type[Payload]) -> tuple[int, Payload | None]:
        """Send op with meta (if any); (the answer's status, its payload when the status is OK)."""
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        header = Header(op=op.code, shard=0, layout=self.layout, seq=self._seq, worker=self.worker_id)
        frames = [header.pack(), *([meta.pack()] if meta is not None else [])]
        answers: list[tuple[int, Payload | None]] = []

        def accept(_: int, received: interface.Received) -> bool:
            answer = protocol.unpack_header(received.header)
            if answer.seq != self._seq:
                return False  # the answer to a request asked again
            if answer.status == Status.OK and not received.frames:
                raise errors.ProtocolError(f"{self._name} answered {op.name} with OK and nothing else")
            answers.append((answer.status, reply.unpack(received.frames[0]) if answer.status == Status.OK else None))
            return True

        fanout.exchange(self._transport, fanout.Exchange([self._link], [frames], ASK_POLICY, [self._name]),
                        accept=accept, stop=self.stop)
        return answers[0]

    def close(self) -> None:
        self._link.close()
