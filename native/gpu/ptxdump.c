/* Prints the kit's embedded PTX (build-time ptxas check; needs no driver). */
#include <stdio.h>

#include "kit_ptx.h"

int main(void) {
    fputs(KIT_PTX, stdout);
    return 0;
}
