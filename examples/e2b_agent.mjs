// A data-analysis agent written against E2B's JavaScript SDK, the way E2B's documentation writes one.
//
// Nothing here is warmbox's: the imports and calls are E2B's (`npm install @e2b/code-interpreter`),
// and the file is run unchanged against warmbox serve (tests/e2b/test_agent_example.py), like its
// Python twin examples/e2b_agent.py:
//
//   export E2B_API_URL=http://127.0.0.1:7420 E2B_SANDBOX_URL=http://127.0.0.1:7420 E2B_API_KEY=<a warmbox key>
//   node examples/e2b_agent.mjs [output dir]
//
// A model would write the code cells; this agent has no network, so its "model" is a fixed plan.
import fs from 'node:fs'
import { Sandbox } from '@e2b/code-interpreter'

// what the model answered to "load the sales data, total it per region and chart it"
const PLAN = [
  "import pandas as pd\ndf = pd.read_csv('sales.csv')\nprint(df.groupby('region').amount.sum().to_string())",
  "import matplotlib.pyplot as plt\ndf.groupby('region').amount.sum().plot(kind='bar')\nplt.show()",
  'df.amount.mean()',
]
const CSV = 'region,amount\nnorth,10\nsouth,5\nnorth,7\neast,3\n'

const outDir = process.argv[2] ?? '.'
const sandbox = await Sandbox.create({ timeoutMs: 300_000, metadata: { agent: 'sales-report-js' } })
try {
  await sandbox.files.write('sales.csv', CSV)
  console.log('files:', (await sandbox.files.list('.')).map((entry) => entry.name))
  for (const [step, code] of PLAN.entries()) {
    const execution = await sandbox.runCode(code)
    if (execution.error) {
      console.log(`step ${step} failed: ${execution.error.name}: ${execution.error.value}`)
      continue
    }
    if (execution.logs.stdout.length) process.stdout.write(execution.logs.stdout.join(''))
    for (const [i, result] of execution.results.entries()) {
      if (result.png) {
        const path = `${outDir}/chart-${step}-${i}.png`
        fs.writeFileSync(path, Buffer.from(result.png, 'base64'))
        console.log('chart:', path)
      } else if (result.text) {
        console.log('result:', result.text)
      }
    }
  }
  const js = await sandbox.runCode('[1, 2, 3].map((n) => n * 2).join(",")', { language: 'js' })
  console.log('js:', js.text)
  const shell = await sandbox.commands.run('wc -l < sales.csv && python3 --version')
  console.log('shell:', shell.stdout.split(/\s+/).filter(Boolean))
} finally {
  await sandbox.kill()
}
