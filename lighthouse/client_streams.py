"""The lighthouse's streams from one replica (``LighthouseStreams``): the session (heartbeats up, epochs down as
deltas, applied to the epoch held) and, for an older lighthouse without sessions, the watch stream. Errors are typed
as the calls' are (``lighthouse.client_rpc``)."""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

import grpc
from google.protobuf.message import DecodeError

from lighthouse.client_rpc import LighthouseRpc, cancelled_by_grpc, translate_error
from lighthouse.epoch_view import EpochView
from lighthouse.errors import LighthouseError, LighthouseUnavailable, NotLeader, SessionsUnsupported
from lighthouse.proto_codec import DeltaView, apply_delta, epoch_from_bytes, update_from_bytes
from lighthouse.v1 import lighthouse_pb2 as pb

WATCH_METHOD = "/fthsdp.v1.Lighthouse/Watch"
SESSION_METHOD = "/fthsdp.v1.Lighthouse/Session"
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # (missing from grpc's stubs)


class LighthouseStreams(LighthouseRpc):
    """One replica's calls and streams to the lighthouse, on the caller's event loop."""

    async def _broken(self, e: grpc.aio.AioRpcError, stream: str, channel: grpc.aio.Channel) -> LighthouseError:
        """A stream's end, typed and counted; an UNAVAILABLE moves on to the next address (or the leader named)."""
        self.errors[e.code().name] += 1
        err = translate_error(e, f"{stream} for replica {self.replica_id} at {self.address}")
        if isinstance(err, LighthouseUnavailable):
            await self._rotate(channel, err.leader if isinstance(err, NotLeader) else "")
        return err

    def _cancelled(self, stream: str) -> LighthouseUnavailable:
        return LighthouseUnavailable(f"{stream} for replica {self.replica_id}: stream cancelled (its channel was "
                                     "closed)")

    async def watch(self, after_epoch: int = 0) -> AsyncIterator[EpochView]:
        """Yield every epoch newer than ``after_epoch`` as it is pushed; raises when the stream breaks."""
        self._stub_now()
        channel = self._channel
        assert channel is not None
        # Raw bytes (no response deserializer): the views are memoized by content, see proto_codec.epoch_from_bytes.
        call = channel.unary_stream(WATCH_METHOD, request_serializer=pb.WatchRequest.SerializeToString,
                                    response_deserializer=None)(
            pb.WatchRequest(job_id=self.job_id, after_epoch=after_epoch, replica_id=self.replica_id,
                            incarnation=self.incarnation), metadata=self._metadata)
        try:
            async for raw in call:
                try:
                    view = epoch_from_bytes(raw)
                except DecodeError as e:
                    raise LighthouseUnavailable(f"Watch for replica {self.replica_id}: bad epoch: {e}") from None
                yield view
        except grpc.aio.AioRpcError as e:
            raise await self._broken(e, "Watch", channel) from None
        except asyncio.CancelledError:
            # The heartbeat closed the shared channel (rotation): the stream broke, the watch loop goes on.
            if not cancelled_by_grpc():
                raise
            raise self._cancelled("Watch") from None
        finally:
            call.cancel()

    async def session(self, held: EpochView | None, beat: Callable[[], tuple[int, int]], interval: Callable[[], float],
                      ranks: int = 1, after_beat: Callable[[], Awaitable[None]] | None = None,
                      ) -> AsyncIterator[EpochView]:
        """This replica group's session: a heartbeat now and every ``interval()`` seconds (``beat()`` gives the
        step and the epoch to send; ``after_beat`` runs after each), and every epoch newer than ``held`` yielded
        as it is pushed, deltas applied to the epoch held. Raises when the stream ends (a typed error: FencedOut,
        UnknownTarget... as a unary heartbeat would; LighthouseUnavailable when it broke; SessionsUnsupported
        from an older lighthouse)."""
        self._stub_now()
        channel = self._channel
        assert channel is not None
        call = channel.stream_stream(SESSION_METHOD, request_serializer=pb.SessionRequest.SerializeToString,
                                     response_deserializer=None)(metadata=self._metadata)  # type: ignore[call-arg]
        loop = asyncio.get_running_loop()
        resync: asyncio.Future[None] = loop.create_future()  # resolved: ask for the full epoch now

        async def heartbeats() -> None:
            # The one writer of the stream (gRPC allows one write at a time): heartbeats, and a resync when asked.
            nonlocal resync
            opening = True
            while True:
                step, epoch = beat()
                wanted = resync.done()
                resync = loop.create_future()
                await call.write(pb.SessionRequest(heartbeat=self._heartbeat_pb(step, epoch), ranks=ranks,
                                                   after_epoch=held.number if opening and held else 0,
                                                   resync=wanted))
                self.heartbeats += 1
                if after_beat is not None:
                    await after_beat()
                # The heartbeat period, jittered (the first one to a random phase), so that groups started together
                # (a job's start) do not beat together; or a resync now. (asyncio.wait, not wait_for: a timeout must
                # not cancel the future, which would then read as done.)
                period = interval() * (random.uniform(0.1, 1.0) if opening else random.uniform(0.9, 1.1))
                opening = False
                await asyncio.wait((resync,), timeout=period)

        writer = asyncio.create_task(heartbeats(), name=f"session-beats-{self.replica_id}")
        current = held
        try:
            while True:
                raw = await call.read()
                if raw is EOF:
                    raise LighthouseUnavailable(f"Session for replica {self.replica_id}: the lighthouse ended it")
                raw = cast(bytes, raw)
                self.update_bytes += len(raw)
                try:
                    update = update_from_bytes(raw)
                except (DecodeError, zlib.error) as e:
                    raise LighthouseUnavailable(f"Session for replica {self.replica_id}: bad update: {e}") from None
                if isinstance(update, DeltaView):
                    if current is None or current.number != update.base:
                        if not resync.done():  # not the epoch the delta is against: ask for the full one
                            resync.set_result(None)
                        continue
                    update = apply_delta(current, update)
                current = update
                yield update
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.errors[e.code().name] += 1
                raise SessionsUnsupported(f"Session at {self.address}: {e.details()}") from None
            raise await self._broken(e, "Session", channel) from None
        except asyncio.CancelledError:
            if not cancelled_by_grpc():
                raise
            raise self._cancelled("Session") from None
        finally:
            writer.cancel()
            call.cancel()
