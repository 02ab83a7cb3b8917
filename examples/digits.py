"""Train a small CNN on scikit-learn's digits with fastt: the code is `fastt.examples.digits` (src/fastt/examples/
digits.py), importable so that `fastt demo` runs it too.

    python examples/digits.py [--small] [--checkpoint digits.pt]
    python -m torch.distributed.run --nproc-per-node 2 examples/digits.py --distributed
"""

from fastt.examples.digits import main

if __name__ == "__main__":
    main()
