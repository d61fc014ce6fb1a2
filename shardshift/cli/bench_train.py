"""placeholder replaced below"""
def register(sub): pass
