"""Hostile or broken clients on a real server (loopback, insecure): bytes that are no valid protobuf of
the method's request type get INVALID_ARGUMENT with a short message on every method, streamed or not,
ours and the health service's, and the log holds one line per method and peer a minute, no traceback."""

from __future__ import annotations

import logging

import grpc
import pytest

GARBAGE = b"\xff\xff\xff\xff"  # a field tag whose varint never ends: no message type parses it

UNARY = ["/foreshock.v1.Jobs/RegisterJob", "/foreshock.v1.Jobs/DrainNode", "/foreshock.v1.Risk/GetNodeRisk",
         "/grpc.health.v1.Health/Check"]
SERVER_STREAMING = ["/foreshock.v1.Jobs/WatchDirectives", "/foreshock.v1.Risk/WatchRisk"]


@pytest.fixture
def channel(plane):
    with grpc.insecure_channel(plane.address) as ch:
        yield ch


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


@pytest.mark.parametrize("method", UNARY)
def test_undecodable_unary_request_is_invalid_argument(channel, method):
    err = _refused(lambda: channel.unary_unary(method)(GARBAGE, timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert method in err.details() and "not a valid message" in err.details() and len(err.details()) < 300


@pytest.mark.parametrize("method", SERVER_STREAMING)
def test_undecodable_request_of_a_streaming_call_is_invalid_argument(channel, method):
    err = _refused(lambda: list(channel.unary_stream(method)(GARBAGE, timeout=5)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err


def test_undecodable_message_in_the_telemetry_stream_is_invalid_argument(channel):
    call = channel.stream_stream("/foreshock.v1.Telemetry/StreamSweeps")
    err = _refused(lambda: list(call(iter([GARBAGE]), timeout=5)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "StreamSweeps" in err.details()


def test_a_flood_of_bad_requests_logs_one_line_and_no_traceback(channel, caplog):
    method = "/foreshock.v1.Jobs/ReportStep"
    with caplog.at_level(logging.INFO):
        for _ in range(20):
            assert _refused(lambda: channel.unary_unary(method)(GARBAGE, timeout=5)).code() == \
                grpc.StatusCode.INVALID_ARGUMENT
    lines = [r for r in caplog.records if method in r.getMessage()]
    assert len(lines) == 1 and "undecodable" in lines[0].getMessage()
    assert "Traceback" not in caplog.text and "Unexpected" not in caplog.text


def test_a_valid_request_still_gets_its_own_answer(channel):
    from foreshock.v1 import risk_pb2
    call = channel.unary_unary("/foreshock.v1.Risk/GetNodeRisk", request_serializer=risk_pb2.GetNodeRiskRequest.SerializeToString)
    err = _refused(lambda: call(risk_pb2.GetNodeRiskRequest(node="n1"), timeout=5))
    assert err.code() == grpc.StatusCode.NOT_FOUND
