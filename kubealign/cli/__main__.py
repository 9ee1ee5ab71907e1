"""`python -m kubealign.cli` (and `torchrun -m kubealign.cli`): the console script."""

from kubealign.cli.parser import console

if __name__ == "__main__":
    console()
