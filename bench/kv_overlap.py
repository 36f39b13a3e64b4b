"""The P→D KV transfer's overlap with the prefill, by prompt length: see trident/bench/kv_overlap.py.

    python bench/kv_overlap.py [--preset small-llava] [--lengths 128,512,1024,2000] [--repeats 3]
                               [--group 4] [--wire native|int8] [--backend auto|ucx|tcp] [--threads 1]

`python bench/ablations.py --overlap LENGTHS` prints the same table with the shipped settings.
"""

from trident.bench.kv_overlap import main

if __name__ == "__main__":
    main()
