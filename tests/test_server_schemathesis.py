"""Fuzzing from OpenAI's published schema: schemathesis generates requests from the operations we
serve in OpenAI's own document (tests/data/openai_schema_subset.json, source and commit named in
it) and sends them to a real `freetoken serve` (demo model, 127.0.0.1, a 128-token context so
every generation stays short). Each response: no 5xx; a 200 valid against the published response
schema (streamed ones are SSE: checked by test_server_schema.py); any other status a 4xx with an
OpenAI error object whose message names the reason. A bounded count per operation
(FREETOKEN_SCHEMATHESIS_EXAMPLES, default 25), derandomized; the counts are printed."""
from __future__ import annotations

import collections
import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from openai_schema import SUBSET  # noqa: E402
from schemathesis.checks import not_a_server_error, response_schema_conformance  # noqa: E402

N = int(os.environ.get("FREETOKEN_SCHEMATHESIS_EXAMPLES", 25))
# the examples and fuzzing phases, schema-valid and invalid data, N cases per operation; not the
# coverage phase (thousands of boundary cases per run, minutes on a 2-core box)
CONFIG = schemathesis.config.SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}}})
schema = schemathesis.openapi.from_path(str(SUBSET), config=CONFIG)
COUNTS: collections.Counter = collections.Counter()
REASONS: collections.Counter = collections.Counter()   # the 4xx messages, first words


@pytest.fixture(scope="module")
def server():
    from server_util import ServerThread

    with ServerThread(max_model_len=128, max_num_seqs=4) as srv:
        yield srv
    print("\nschemathesis responses by (operation, status):", dict(sorted(COUNTS.items())))
    print("most frequent refusals:", REASONS.most_common(25))


def _refusal_is_documented(response) -> None:
    """A 4xx carries OpenAI's error object with a message (the documented reason)."""
    err = response.json().get("error")
    REASONS[(err or {}).get("message", "")[:70]] += 1
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], response.text
    assert err.get("type") and "param" in err and "code" in err, response.text


@schema.parametrize()
@settings(max_examples=N, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_requests_from_the_published_schema(server, case):
    response = case.call(base_url=server.base_url, timeout=120)
    COUNTS[(f"{case.method} {case.path}", response.status_code)] += 1
    if response.status_code == 200 and "text/event-stream" in str(response.headers.get("content-type")):
        # schemathesis reads the document's text/event-stream schema as the schema of the whole
        # SSE event; OpenAI's means each event's JSON data: test_server_schema.py checks those
        case.validate_response(response, checks=[not_a_server_error])
        return
    case.validate_response(response, checks=[not_a_server_error]
                           + ([response_schema_conformance] if response.status_code == 200 else []))
    if response.status_code != 200:
        assert 400 <= response.status_code < 500
        _refusal_is_documented(response)
