"""Write the first N ShareGPT records as `.carry/sharegpt.json.gz` (about 9 MB for 6,000), the data that
`bench/gpu_session.sh` carries to the device machine beside the stage pieces.

    python3 bench/sharegpt_subset.py [N]
"""
import gzip
import json
import sys
from pathlib import Path


def main(n: int = 6000, out: str = ".carry/sharegpt.json.gz") -> None:
    from eyas.data.readers import sharegpt_path

    text = sharegpt_path().read_text()
    dec, i, recs = json.JSONDecoder(), text.index("{"), []
    while len(recs) < n:
        try:
            rec, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # the packaged file ends mid-record
            break
        recs.append(rec)
        i = text.find("{", end)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_bytes(gzip.compress(json.dumps(recs).encode(), 9, mtime=0))
    print(f"{len(recs)} records -> {out}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6000)
