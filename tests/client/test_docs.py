"""docs/protocol.md shows the schemas the code enforces."""

import json
from pathlib import Path

from agentkv.protocol import EVENTS_SCHEMA, STATS_SCHEMA

DOC = Path(__file__).parents[2] / "docs" / "protocol.md"


def test_protocol_doc_carries_the_schemas_verbatim():
    text = DOC.read_text()
    assert json.dumps(EVENTS_SCHEMA, indent=2) in text
    assert json.dumps(STATS_SCHEMA, indent=2) in text
