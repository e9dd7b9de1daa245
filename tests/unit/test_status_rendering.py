"""/admin/status renders whatever numbers a replica reports: NaN and infinities become null, the
rest is unchanged, and the body is valid JSON (starlette refuses non-finite floats with a 500)."""

import json
import math

from starlette.responses import JSONResponse

from app.ingress import finite


def test_non_finite_numbers_render_as_null():
    bucket = {"verify_max_abs_diff": math.nan, "capture_s": 0.01}
    replica = {"buckets": {"decode_bs_8": bucket}, "stats": {"tpot_s": [math.inf, -math.inf, 1.5]}, "state": "READY"}
    body = json.loads(JSONResponse(finite({"replicas": {"r1": replica}})).body)
    rendered = body["replicas"]["r1"]
    assert rendered["buckets"]["decode_bs_8"] == {"verify_max_abs_diff": None, "capture_s": 0.01}
    assert rendered["stats"]["tpot_s"] == [None, None, 1.5]
    assert rendered["state"] == "READY"
