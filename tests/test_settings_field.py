"""Adding a session setting is one field in `streaming/settings.py`: a field added at test time (before any front end
is imported, in a process of its own) is a `stream-qa` option, a field of the server's request schema, a control of
the app's page and a key of what a session folder keeps, with nothing else touched."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys, tempfile
    from pathlib import Path

    import streaming.settings as st

    # the new setting, as a developer would write it in Settings: a default, a meaning, bounds
    extra = ("sharpness", float | None, st._field(None, "how sharp frames are made before perception", ge=0))
    st.Settings = dataclasses.make_dataclass("Settings", [extra], bases=(st.Settings,), frozen=True)
    st.Settings.__module__ = "streaming.settings"

    from streaming.cli import SESSION_SETTINGS, build_parser
    from serve.schema import OpenRequest, SessionSettings
    from app.ui import build
    from streaming.session_dir import SETTINGS, SessionDir

    out = {}
    args = build_parser().parse_args(["--sharpness", "0.5"])
    out["cli"] = args.sharpness
    try:
        build_parser().parse_args(["--sharpness", "x"])
    except SystemExit as err:
        out["cli_refuses"] = err.code
    out["cli_checked"] = st.problem({"sharpness": -1.0})
    out["schema"] = "sharpness" in OpenRequest.model_fields and "sharpness" in SessionSettings.model_fields
    out["schema_description"] = OpenRequest.model_fields["sharpness"].description
    demo = build()
    controls = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    out["app"] = controls["setting-sharpness"].label if "setting-sharpness" in controls else None
    with tempfile.TemporaryDirectory() as tmp:
        folder = SessionDir(Path(tmp) / "s", resume=False)
        folder.save_settings({k: getattr(args, k) for k in SESSION_SETTINGS})  # what stream-qa --session keeps
        out["cli_folder"] = json.loads((folder.path / SETTINGS).read_text()).get("sharpness")
        folder.close()
    out["server_folder"] = st.Settings(sharpness=0.25).as_dict().get("sharpness")  # what the server's folder keeps
    print(json.dumps(out))
""")


def test_a_setting_added_as_one_field_reaches_every_front_end_and_the_session_folder():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["cli"] == 0.5 and got["cli_refuses"] == 2 and got["cli_checked"] == "sharpness must be a finite " \
        "number ≥ 0, got -1.0", got
    assert got["schema"] and got["schema_description"] == "how sharp frames are made before perception", got
    assert got["app"] == "how sharp frames are made before perception (sharpness)", got
    assert got["cli_folder"] == 0.5 and got["server_folder"] == 0.25, got
