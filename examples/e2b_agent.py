"""A data-analysis agent written against E2B's SDK, the way E2B's documentation writes one.

Nothing here is warmbox's: the imports and calls are E2B's (``pip install e2b-code-interpreter``),
and the file is run unchanged against warmbox serve (tests/e2b/test_agent_example.py):

    export E2B_API_URL=http://127.0.0.1:7420 E2B_SANDBOX_URL=http://127.0.0.1:7420 E2B_API_KEY=<a warmbox key>
    python examples/e2b_agent.py [output dir]

A model would write the code cells; this agent has no network, so its "model" is a fixed plan.
"""

import base64
import sys

from e2b_code_interpreter import Sandbox

# what the model answered to "load the sales data, total it per region and chart it"
PLAN = [
    "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint(df.groupby('region').amount.sum().to_string())",
    "import matplotlib.pyplot as plt\ndf.groupby('region').amount.sum().plot(kind='bar')\nplt.show()",
    "df.amount.mean()",
]
CSV = "region,amount\nnorth,10\nsouth,5\nnorth,7\neast,3\n"


def main(out_dir: str) -> None:
    with Sandbox.create(timeout=300, metadata={"agent": "sales-report"}) as sandbox:
        sandbox.files.write("sales.csv", CSV)
        print("files:", [entry.name for entry in sandbox.files.list(".")])
        for step, code in enumerate(PLAN):
            execution = sandbox.run_code(code)
            if execution.error:
                print(f"step {step} failed: {execution.error.name}: {execution.error.value}")
                continue
            if execution.logs.stdout:
                print("".join(execution.logs.stdout), end="")
            for i, result in enumerate(execution.results):
                if result.png:
                    path = f"{out_dir}/chart-{step}-{i}.png"
                    with open(path, "wb") as f:
                        f.write(base64.b64decode(result.png))
                    print("chart:", path)
                elif result.text:
                    print("result:", result.text)
        shell = sandbox.commands.run("wc -l < sales.csv && python3 --version")
        print("shell:", shell.stdout.split())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
