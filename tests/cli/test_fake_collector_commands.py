"""`iop fake-collector`: spans exported over OTLP/gRPC by the OpenTelemetry SDK, shown as JSON."""

from __future__ import annotations

import asyncio

import httpx
import orjson
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, set_span_in_context

from iop.processes import iop_command, terminate


async def test_it_shows_the_spans_it_received_and_forgets_them_on_reset() -> None:
    process = await asyncio.create_subprocess_exec(
        *iop_command(),
        "fake-collector",
        "--otlp-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        started = orjson.loads(await asyncio.wait_for(process.stdout.readline(), 30))
        exporter = OTLPSpanExporter(endpoint=f"http://{started['otlp']}", insecure=True)
        provider = TracerProvider(resource=Resource.create({"service.name": "a-test"}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("test")
        parent = tracer.start_span("chat m", kind=SpanKind.SERVER, attributes={"n": 3})
        child = tracer.start_span("iop.run", context=set_span_in_context(parent))
        child.end()
        parent.end()
        provider.shutdown()

        async with httpx.AsyncClient(base_url=f"http://{started['http']}") as http:
            spans = (await http.get("/spans")).json()
            assert [(s["name"], s["kind"], s["service"]) for s in spans] == [
                ("iop.run", "internal", "a-test"),
                ("chat m", "server", "a-test"),
            ]
            run, chat = spans
            assert run["parent_span_id"] == chat["span_id"] and run["trace_id"] == chat["trace_id"]
            assert chat["parent_span_id"] == "" and chat["attributes"] == {"n": 3}
            assert chat["span_id"] == f"{parent.get_span_context().span_id:016x}"
            assert (await http.post("/reset")).status_code == 200
            assert (await http.get("/spans")).json() == []
    finally:
        await terminate(process)
