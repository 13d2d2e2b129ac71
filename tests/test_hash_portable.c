/* test_hash.c again with kvblock.h's portable 128-bit product (KVB_NO_INT128: four 32 x 32-bit
 * products instead of unsigned __int128): the same vectors and the same agreement with the manual, so
 * both paths give the same hashes. */
#define KVB_NO_INT128
#include "test_hash.c"
