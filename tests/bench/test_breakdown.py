"""bench.breakdown's host profile: the function a call spends its host time in is named, with its call count."""

from flamia_gen.bench.breakdown import host_profile


def _slow_part(n):
    return sum(i * i for i in range(n))


def _call():
    _slow_part(20000)


def test_host_profile_names_the_functions_of_the_call():
    text = host_profile(_call, calls=7, top=10)
    line = next(ln for ln in text.splitlines() if "_slow_part" in ln)
    assert line.split()[0] == "7"  # ncalls: once per call, after the untimed first call
    assert "function calls" in text
