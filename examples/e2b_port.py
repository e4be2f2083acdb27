"""A typical E2B code-interpreter agent, ported to warmbox (issue 16's yardstick).

The E2B original (``e2b-code-interpreter``), 22 lines:

    import base64, sys, urllib.request
    from e2b_code_interpreter import Sandbox

    out = sys.argv[1] if len(sys.argv) > 1 else "."
    sbx = Sandbox.create(timeout=300)
    sbx.files.write("/home/user/data.csv", "x,y\\n1,1\\n2,4\\n3,9\\n")
    ex = sbx.run_code(
        "import pandas as pd, matplotlib.pyplot as plt\\n"
        "df = pd.read_csv('/home/user/data.csv')\\n"
        "print(df.y.sum())\\n"
        "df.plot(x='x', y='y'); plt.show()"
    )
    print("stdout:", "".join(ex.logs.stdout).strip())
    for i, r in enumerate(ex.results):
        if r.png:
            open(f"{out}/chart{i}.png", "wb").write(base64.b64decode(r.png))
    server = sbx.commands.run("python3 -m http.server 8000", background=True, cwd="/home/user")
    host = sbx.get_host(8000)
    print(urllib.request.urlopen(f"https://{host}/data.csv").read().decode())
    server.kill()
    sbx.kill()

Below, the same agent on warmbox. Lines that differ are marked ``# differs:`` with the reason
(docs/guides/from-e2b.md lists them). It runs in process by default, or against a warmbox
server when WARMBOX_API_URL (and WARMBOX_API_KEY) are set.
"""

import base64
import sys
import urllib.request

from warmbox import Sandbox  # differs: the package name

out = sys.argv[1] if len(sys.argv) > 1 else "."
sbx = Sandbox.create(timeout=300)
sbx.files.write("/home/user/data.csv", "x,y\n1,1\n2,4\n3,9\n")
ex = sbx.run_code(
    "import pandas as pd, matplotlib.pyplot as plt\n"
    "df = pd.read_csv('/home/user/data.csv')\n"
    "print(df.y.sum())\n"
    "df.plot(x='x', y='y'); plt.show()"
)
print("stdout:", "".join(ex.logs.stdout).strip())
for i, r in enumerate(ex.results):
    if r.png:
        open(f"{out}/chart{i}.png", "wb").write(base64.b64decode(r.png))
server = sbx.commands.run("python3 -m http.server 8000", background=True, cwd="/home/user")
host = sbx.get_host(8000)
print(urllib.request.urlopen(f"http://{host}/data.csv").read().decode())  # differs: http, a loopback forward
server.kill()
sbx.kill()
