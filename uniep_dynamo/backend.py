class UniepOptions: pass
def uniep_backend(*a, **k): pass
