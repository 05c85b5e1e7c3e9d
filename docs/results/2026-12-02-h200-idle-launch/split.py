"""The caught and uncaught idle arrivals' delay split by the server's stamps, each paired with the
same request alone in the same call (request index; idle at send in both): the table at the top of
2026-12-02-h200-idle-launch.md.

    python3 split.py BENCH.json [BENCH.json ...]   # bench.py report.json files with alone and a gate
"""
import json, sys, statistics as st
def runs(path):
    r=json.load(open(path)); out={}
    for run in r['runs']:
        out.setdefault(run['config'],[]).append(run)
    pr={}
    for ld in r['loads']:
        for cfg,row in ld['rows'].items():
            for x in row.get('per_request') or []:
                pr[(cfg,x['send_ns'])]=x
    return out,pr
def recs(run):
    # keyed by request index i
    return {x['i']:x for x in run['records'] if x.get('error') is None and x.get('idle_at_send')}
tot={}
for path in sys.argv[1:]:
    out,pr=runs(path)
    if 'alone' not in out: continue
    a=recs(out['alone'][0])
    for cfg in out:
        if cfg=='alone': continue
        g=recs(out[cfg][0])
        for i,x in g.items():
            if i not in a: continue
            y=a[i]
            c=pr.get((cfg,x['send_ns']),{}).get('already_stopped')
            key=(cfg,'caught' if c else 'uncaught')
            d=[(x[k2]-x[k1])-(y[k2]-y[k1]) for k1,k2 in (('send_ns','recv_ns'),('recv_ns','launch_ns'),('launch_ns','gpu_start_ns'),('send_ns','gpu_start_ns'))]
            tot.setdefault(key,[]).append(d)
for key,v in sorted(tot.items()):
    med=[st.median([d[j] for d in v])/1e3 for j in range(4)]
    print(key,len(v),'median diff vs alone (us): send->recv %.1f recv->launch %.1f launch->gpu %.1f total %.1f'%tuple(med))
