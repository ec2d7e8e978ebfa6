for v in v1 v4; do
  for d in 128 64; do
    pages=16,32; [ $d = 128 ] && pages=16,32,64,256
    echo "== $v d$d"; PYTHONPATH=build/gx/$v timeout 80 python3 .ci/bench_paged_prefill.py --pages $pages --head-dim $d 2>&1 | grep "^| [0-9]"  | sort -u
  done
done
