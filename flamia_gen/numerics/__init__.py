from .formats import decode, decode_e2m1, decode_e4m3, decode_e5m2, decode_ue8m0, encode, encode_e2m1, encode_e4m3, encode_e5m2, encode_ue8m0, pack_e2m1, unpack_e2m1
from .hadamard import fwht
from .quantize import Quantized, fake_quantize, quantize
from .metrics import cosine, max_rel_change, rel_error, sqnr_db
from .reference import attention, attention_backward
from .probe import ProbeResult, leakage_probe
from .delta import delta_from_quantized
