"""The code interpreter as E2B's: charts and rich results, display(), logs, result callbacks, languages."""

from __future__ import annotations

import base64
import struct

import pytest

from warmbox import BackendUnavailable, ContextError, InvalidArgument, Sandbox, UnsupportedLanguage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(b64: str | None) -> tuple[int, int]:
    """Width and height of a base64 PNG (its IHDR), after checking it is one."""
    assert b64 is not None
    data = base64.b64decode(b64, validate=True)
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR" and len(data) > 1000
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def open_tier(tier: str, **kw) -> Sandbox:
    try:
        return Sandbox.create(tier=tier, timeout=600, **kw)
    except BackendUnavailable as e:
        pytest.skip(f"the {tier} tier is not available here: {e}")


@pytest.fixture(scope="module")
def box(home, runc_ready):
    with Sandbox.create(tier="container", timeout=600) as sb:
        yield sb


CHART = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nplt.show()\nprint('shown')"


@pytest.mark.sandbox
def test_plt_show_gives_a_png_result(box):
    e = box.run_code(CHART)
    assert e.error is None, e.error
    assert e.stdout == "shown\n" and "non-interactive" not in e.stderr
    (chart,) = e.results
    assert not chart.is_main_result and chart.formats() == ["png"] and chart.text.startswith("<Figure size")
    w, h = png_size(chart.png)
    assert 300 < w < 2000 and 200 < h < 2000
    # shown figures are closed: the next cell draws no stale chart
    assert box.run_code("len(plt.get_fignums())").text == "0"


@pytest.mark.sandbox
def test_a_figure_as_last_expression_is_the_main_result(box):
    e = box.run_code("import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.bar(['a', 'b'], [1, 2])\nfig")
    assert e.error is None, e.error
    (main,) = e.results  # once: not again as an unshown figure at the end of the cell
    assert main.is_main_result and png_size(main.png)
    # a figure drawn and not shown still becomes a result at the end of the cell, as in Jupyter
    e = box.run_code("plt.plot([1, 2]); 7")
    assert [r.is_main_result for r in e.results] == [True, False]
    assert e.text == "7" and png_size(e.results[1].png)


@pytest.mark.sandbox
def test_rich_representations_and_display(box):
    e = box.run_code("import pandas as pd\npd.DataFrame({'col': [1, 2]})")
    (df,) = e.results
    assert df.is_main_result and "<table" in df.html and "col" in df.text and df.formats() == ["html"]
    code = """
class Rich:
    def _repr_markdown_(self): return '**bold**'
    def _repr_latex_(self): return r'$x^2$'
    def _repr_json_(self): return {'k': [1, 2]}

class Bundle:
    def _repr_mimebundle_(self, include=None, exclude=None):
        return {'text/html': '<b>b</b>', 'image/svg+xml': '<svg/>', 'text/plain': 'B!'}

display(Rich())
display(Bundle())
'main'
"""
    e = box.run_code(code)
    assert e.error is None, e.error
    rich, bundle, main = e.results
    assert (rich.markdown, rich.latex, rich.json) == ("**bold**", "$x^2$", '{"k": [1, 2]}')
    assert rich.formats() == ["markdown", "latex", "json"] and not rich.is_main_result
    assert (bundle.html, bundle.svg, bundle.text) == ("<b>b</b>", "<svg/>", "B!")
    assert main.is_main_result and e.text == "'main'"


@pytest.mark.sandbox
def test_logs_are_lists_of_lines(box):
    e = box.run_code("import sys\nprint('a'); print('b')\nprint('c', file=sys.stderr)")
    assert (e.stdout, e.stderr) == ("a\nb\n", "c\n")
    assert (e.logs.stdout, e.logs.stderr) == (["a\n", "b\n"], ["c\n"])


@pytest.mark.sandbox
def test_the_pydata_template_has_pyplot_imported(home, runc_ready):
    # the first argument is the template, as in E2B (issue 34, item 11); a tier there says to use tier=
    for name in ("gvisor", "runc", "auto"):
        with pytest.raises(InvalidArgument, match=f"is a tier, not a template: Sandbox.create\\(tier='{name}'\\)"):
            Sandbox.create(name, timeout=120)
    with Sandbox.create("pydata", timeout=120) as sb:
        assert sb.get_info().template == "pydata"
        assert sb.run_code("import sys; 'matplotlib.pyplot' in sys.modules").text == "True"
        assert png_size(sb.run_code("matplotlib.pyplot.plot([1]); matplotlib.pyplot.show()").results[0].png)


@pytest.mark.sandbox
def test_callbacks_stream_results_and_errors(box):
    """on_result gets each result while the cell still runs (here before its last print)."""
    events: list[tuple[str, object]] = []
    code = "import time\ndisplay(1)\ntime.sleep(0.5)\nprint('late')\ndisplay(2)\n3"
    e = box.run_code(
        code,
        on_stdout=lambda s: events.append(("out", s)),
        on_result=lambda r: events.append(("result", (r.text, r.is_main_result))),
        on_error=lambda err: events.append(("error", err)),
    )
    assert events == [
        ("result", ("1", False)),
        ("out", "late"),
        ("out", "\n"),
        ("result", ("2", False)),
        ("result", ("3", True)),
    ]
    assert [r.text for r in e.results] == ["1", "2", "3"]
    errors = []
    e = box.run_code("1 / 0", on_error=errors.append, on_result=errors.append)
    assert errors == [e.error] and e.error.name == "ZeroDivisionError"


@pytest.mark.sandbox
def test_matplotlib_in_commands_and_a_fresh_cache(box):
    """A command's Python has matplotlib too (Agg from /etc/matplotlibrc); the font list was made
    in the image, so a context's first import finds it in the user's cache."""
    r = box.commands.run(
        "python3 -c \"import matplotlib, matplotlib.pyplot as plt; plt.plot([1]); plt.savefig('/tmp/c.png'); "
        'print(matplotlib.get_backend())"'
    )
    assert (r.exit_code, r.stdout, r.stderr) == (0, "agg\n", "")
    assert box.files.read("/tmp/c.png", format="bytes")[:8] == PNG_MAGIC
    ctx = box.create_code_context(envs={"MPLCONFIGDIR": "/tmp/mpl-fresh"})
    e = box.run_code("import os; os.listdir('/tmp/mpl-fresh')", context=ctx)  # before any matplotlib import
    assert e.text.startswith("['fontlist-v") and e.text.endswith(".json']")
    box.remove_code_context(ctx)


@pytest.mark.sandbox
def test_charts_and_languages_on_gvisor(home, runc_ready):
    with open_tier("gvisor") as sb:
        e = sb.run_code(CHART)
        assert e.error is None, e.error
        assert png_size(e.results[0].png)
        assert sb.run_code("const v = await Promise.resolve(6); v * 7", language="javascript").text == "42"
        assert sb.run_code("cd /tmp; N=3", language="bash").error is None
        assert sb.run_code("echo $N $PWD", language="bash").stdout == "3 /tmp\n"


@pytest.mark.sandbox
def test_javascript_context_keeps_state_and_awaits(box):
    js = box.create_code_context(language="javascript")
    assert js.language == "javascript"
    e = box.run_code("const x = await Promise.resolve(41);\nconsole.log('got', x);\nx + 1", context=js)
    assert e.error is None, e.error
    assert (e.text, e.stdout) == ("42", "got 41\n") and e.results[0].is_main_result
    e = box.run_code("let y = x * 2; function f(a) { return a + y }\nf(1)", context=js)
    assert e.text == "83"
    assert box.run_code("typeof require('fs').readFileSync", context=js).text == "'function'"
    e = box.run_code("import os from 'os'\nimport { join as j } from 'path'\nj('/a', os.platform())", context=js)
    assert e.text == "'/a/linux'", e.error
    e = box.run_code("null.foo", context=js)
    assert e.error.name == "TypeError" and "null" in e.error.value and "<cell" in e.error.traceback
    e = box.run_code("await new Promise(() => {})", context=js, timeout=1)
    assert e.timed_out and e.error is not None
    e = box.run_code("while (true) {}", context=js, timeout=1)
    assert e.timed_out and e.error is not None
    assert box.run_code("y", context=js).text == "82"  # state survived both interrupts
    # run_code(language=) uses one default context per language
    assert box.run_code("globalThis.z = 5", language="js").text == "5"
    assert box.run_code("z", language="javascript").text == "5"


@pytest.mark.sandbox
def test_bash_context_keeps_cwd_and_variables(box):
    sh = box.create_code_context(language="bash")
    e = box.run_code("cd /tmp && mkdir -p wbdir && cd wbdir\nGREET=hello\necho $GREET; echo oops >&2", context=sh)
    assert (e.stdout, e.stderr, e.error) == ("hello\n", "oops\n", None)
    e = box.run_code("pwd; echo $GREET-again", context=sh)
    assert e.stdout == "/tmp/wbdir\nhello-again\n"
    e = box.run_code("ls /nope", context=sh)
    assert e.error.name == "ExitCode" and e.error.value == "2" and "/nope" in e.stderr
    e = box.run_code("sleep 100; echo after", context=sh, timeout=1)
    assert e.timed_out and "after" not in e.stdout
    assert box.run_code("echo $GREET; pwd", language="bash").stdout == "\n/home/user\n"  # its own context
    assert box.run_code("echo $GREET", context=sh).stdout == "hello\n"


@pytest.mark.sandbox
def test_unknown_language_is_a_typed_error(box):
    with pytest.raises(UnsupportedLanguage) as e:
        box.create_code_context(language="cobol")
    assert isinstance(e.value, InvalidArgument)
    assert e.value.language == "cobol" and set(e.value.available) == {"python", "javascript", "bash"}
    assert "python, javascript, bash" in str(e.value)
    with pytest.raises(UnsupportedLanguage):
        box.run_code("1", language="cobol")
    with pytest.raises(InvalidArgument):
        box.run_code("1", language="python", context="default-bash")


@pytest.mark.sandbox
def test_javascript_bash_and_charts_on_microvm(home, runc_ready):
    with open_tier("microvm") as sb:
        assert sb.run_code("const v = await Promise.resolve(6); v * 7", language="javascript").text == "42"
        assert sb.run_code("cd /tmp; echo $PWD", language="bash").stdout == "/tmp\n"
        r = sb.commands.run("python3 -c 'import matplotlib'")
        if r.exit_code != 0:
            pytest.skip(f"the microVM image has no matplotlib (its guest packages lack python3-matplotlib): {r.stderr}")
        assert sb.commands.run("ls /opt/warmbox/matplotlib").stdout.startswith("fontlist-v")  # the guest's own
        e = sb.run_code(CHART)
        assert e.error is None, e.error
        assert png_size(e.results[0].png)


@pytest.mark.sandbox
def test_contexts_listed_restarted_and_envs_for_one_run(box):
    py = box.create_code_context(cwd="/tmp")
    js = box.create_code_context(language="javascript")
    sh = box.create_code_context(language="bash")
    listed = {c.id: c for c in box.list_code_contexts()}
    assert listed[py.id] == py and listed[js.id] == js and listed[sh.id] == sh
    # variables for one run only, in each language; after it, as before (unset, or the old value)
    box.run_code("import os; os.environ['KEEP'] = 'old'", context=py)
    runs = {
        py: (
            "import os; print(os.environ['WB_ONE'], os.environ['KEEP'])",
            "import os; print(os.environ.get('WB_ONE'), os.environ['KEEP'])",
        ),
        js: ("console.log(process.env.WB_ONE, process.env.KEEP)", "console.log(process.env.WB_ONE, process.env.KEEP)"),
        sh: ("echo $WB_ONE $KEEP", 'echo "${WB_ONE-unset}" "${KEEP-unset}"'),
    }
    after = {py: "None old\n", js: "undefined undefined\n", sh: "unset unset\n"}
    for ctx, (during, later) in runs.items():
        e = box.run_code(during, context=ctx, envs={"WB_ONE": "1 'two'", "KEEP": "new"})
        assert e.error is None and e.stdout.startswith("1 'two' new"), (ctx.language, e)
        assert box.run_code(later, context=ctx).stdout == after[ctx], ctx.language
    with pytest.raises(InvalidArgument):
        box.run_code("1", context=py, envs={"A=B": "x"})
    # a restart keeps the id, language and directory, and drops the state
    box.run_code("x = 41", context=py)
    box.run_code("globalThis.y = 1", context=js)
    for ctx in (py, js):
        box.restart_code_context(ctx)
    assert box.run_code("import os; os.getcwd()", context=py).text == "'/tmp'"
    assert box.run_code("'x' in dir()", context=py).text == "False"
    assert box.run_code("typeof y", context=js).text == "'undefined'"
    assert {c.id: c for c in box.list_code_contexts()}[py.id] == py
    with pytest.raises(ContextError):
        box.restart_code_context("ctx-nope")
    for ctx in (py, js, sh):
        box.remove_code_context(ctx)
    assert py.id not in {c.id for c in box.list_code_contexts()}


@pytest.mark.sandbox
def test_create_with_run_code_runs_the_first_cell_in_the_same_request(home, runc_ready):
    """create(run_code=...): one request (one round trip over HTTP); the cell ran in the default
    context the next run_code uses, its time is the first_command stage, and an error of the code
    is in the execution with the sandbox alive."""
    with Sandbox.create(tier="container", timeout=120, run_code="x = 2 + 2\nprint(x)\nx") as sb:
        first = sb.first_execution
        assert first is not None and first.error is None, first
        assert first.stdout == "4\n" and first.text == "4"
        assert sb.run_code("x + 1").text == "5"  # the same context
        assert [t for t in sb.get_timings() if t == "first_command"] == ["first_command"]
    with Sandbox.create(tier="container", timeout=120, run_code="1/0") as sb:
        assert sb.first_execution is not None and sb.first_execution.error is not None
        assert sb.first_execution.error.name == "ZeroDivisionError"
        assert sb.commands.run("true").exit_code == 0
    with pytest.raises(InvalidArgument):
        Sandbox.create(tier="container", timeout=120, run_code=7)  # type: ignore[arg-type]
